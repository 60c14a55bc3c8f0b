"""The token ledger, and the run summary over all three ledgers (docs/design.md#ledgers): goodput and
bandwidth are outputs of a run. Bytes are in diloco.algo.traffic, time in diloco.algo.timeline.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428): goodput, uptime and bandwidth are
the paper's headline measures, so they are booked from events, never estimated afterwards.

Every ledger is an immutable value; each `add`-style function returns a new one. Event logs grow
by whole numpy chunks plus a short tuple tail, so appending costs O(1) amortised without mutation.

Token ledger, per fragment p (every token a learner processes is processed once for every p):

    processed_p = merged_p + sum_r dropped_p[r] + lost_p + outstanding_p

* processed_p: tokens of every inner step of every learner incarnation.
* outstanding_p: tokens not yet resolved: `pending` (processed, not yet sent) plus `in_flight`
  (sent in a contribution the syncer has not yet merged or dropped).
* A contribution carries the tokens processed since the learner's previous send of p (not its
  c_tokens, which counts since the last *apply* of p and can repeat tokens of an earlier send
  still in flight); so every token is in at most one contribution.
* merged_p: in a contribution that entered a merge of p.
* dropped_p[r]: "stale" (max_staleness cut-off), "excluded" (the syncer left it out, e.g. too
  late for any round), "quarantined:<reason>" (a messages.QUARANTINE_REASONS reason), and
  "overwritten": pending when the learner applied a global version of p. The learner resets
  c_steps/c_tokens there (docs/algorithm.md#applying-merged-fragments), so these tokens (the tau overlap steps after a
  send, with alpha = 0 also their update to p) never reach the syncer. An apply that keeps the
  local progress (fragments.keep_overlap) leaves them pending: they ride in the next send.
* lost_p: pending when the learner incarnation died, in a contribution lost in transit, or of
  steps whose events never reached the syncer (`lose`: booked processed and lost at once).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from diloco.algo.eventlog import LedgerError  # noqa: F401  (callers catch one error type for all ledgers)
from diloco.algo.messages import QUARANTINE_REASONS
from diloco.algo.timeline import TimeLedger, goodput, seconds, uptime
from diloco.algo.traffic import DIRECTIONS, ByteLedger, byte_events, mean_rate, peak_rate

DROP_REASONS = ("stale", "excluded", "overwritten") + tuple(f"quarantined:{r}" for r in QUARANTINE_REASONS)

Incarnation = tuple[int, int]  # (learner, incarnation)
MessageKey = tuple[int, int, int]  # (learner, incarnation, seq)


class TokenLedger(NamedTuple):
    """Token counts per fragment (see the module docstring for the equation they satisfy)."""

    processed: tuple[int, ...]  # per fragment
    merged: tuple[int, ...]
    dropped: dict[str, tuple[int, ...]]  # reason -> per fragment
    lost: tuple[int, ...]
    pending: dict[Incarnation, tuple[int, ...]]  # processed, not yet sent, per fragment
    in_flight: dict[MessageKey, tuple[int, int]]  # sent, unresolved: (fragment, tokens)
    dead: frozenset[Incarnation]
    unmatched: int  # resolutions of messages never in flight (duplicates, forgeries): no tokens

    @property
    def num_fragments(self) -> int:
        return len(self.processed)


def token_ledger(num_fragments: int) -> TokenLedger:
    zeros = (0,) * num_fragments
    return TokenLedger(zeros, zeros, {}, zeros, {}, {}, frozenset(), 0)


def _add(xs: tuple[int, ...], p: int, n: int) -> tuple[int, ...]:
    return xs[:p] + (xs[p] + n,) + xs[p + 1:]


def _plus(xs: tuple[int, ...], ys: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip(xs, ys))


def process(led: TokenLedger, learner: int, incarnation: int, tokens: int) -> TokenLedger:
    """One inner step of `tokens` tokens: processed once for every fragment."""
    key = (learner, incarnation)
    if key in led.dead:
        raise LedgerError(f"learner {learner} incarnation {incarnation} is dead and cannot process")
    if tokens < 0:
        raise LedgerError(f"tokens must be >= 0, got {tokens}")
    step = (tokens,) * led.num_fragments
    pending = dict(led.pending)
    pending[key] = _plus(pending.get(key, (0,) * led.num_fragments), step)
    return led._replace(processed=_plus(led.processed, step), pending=pending)


def _take_pending(led: TokenLedger, learner: int, incarnation: int, fragment: int) -> tuple[int, dict]:
    if not 0 <= fragment < led.num_fragments:
        raise LedgerError(f"fragment {fragment} outside 0..{led.num_fragments - 1}")
    key = (learner, incarnation)
    row = led.pending.get(key, (0,) * led.num_fragments)
    pending = dict(led.pending)
    pending[key] = _add(row, fragment, -row[fragment])
    return row[fragment], pending


def send(led: TokenLedger, learner: int, incarnation: int, fragment: int, seq: int) -> TokenLedger:
    """The learner sent its contribution for `fragment` with sequence number `seq`."""
    key = (learner, incarnation, seq)
    if key in led.in_flight:
        raise LedgerError(f"message {key} is already in flight")
    if (learner, incarnation) in led.dead:
        raise LedgerError(f"learner {learner} incarnation {incarnation} is dead and cannot send")
    tokens, pending = _take_pending(led, learner, incarnation, fragment)
    return led._replace(pending=pending, in_flight={**led.in_flight, key: (fragment, tokens)})


def apply(led: TokenLedger, learner: int, incarnation: int, fragment: int) -> TokenLedger:
    """The learner applied a global version of `fragment`, resetting its counters for it."""
    tokens, pending = _take_pending(led, learner, incarnation, fragment)
    dropped = _dropped_plus(led, "overwritten", fragment, tokens)
    return led._replace(pending=pending, dropped=dropped)


def _dropped_plus(led: TokenLedger, reason: str, fragment: int, tokens: int) -> dict[str, tuple[int, ...]]:
    if reason not in DROP_REASONS:
        raise LedgerError(f"unknown drop reason {reason!r}; known: {DROP_REASONS}")
    row = led.dropped.get(reason, (0,) * led.num_fragments)
    return {**led.dropped, reason: _add(row, fragment, tokens)}


def resolve(led: TokenLedger, key: MessageKey, outcome: str, into: MessageKey | None = None) -> TokenLedger:
    """The fate of a sent contribution: "merged", "lost" (in transit), "carried" (a newer
    contribution `into` of the same learner holds its progress and takes its tokens; "excluded" if
    `into` is not in flight for the same fragment), or a drop reason.

    A message that is not in flight (a duplicate delivery, or a header naming a message never sent)
    carries no tokens of its own: it only counts in `unmatched`.
    """
    if key not in led.in_flight:
        return led._replace(unmatched=led.unmatched + 1)
    fragment, tokens = led.in_flight[key]
    in_flight = {k: v for k, v in led.in_flight.items() if k != key}
    if outcome == "merged":
        return led._replace(in_flight=in_flight, merged=_add(led.merged, fragment, tokens))
    if outcome == "lost":
        return led._replace(in_flight=in_flight, lost=_add(led.lost, fragment, tokens))
    if outcome == "carried":
        if into in in_flight and in_flight[into][0] == fragment:
            in_flight[into] = (fragment, in_flight[into][1] + tokens)
            return led._replace(in_flight=in_flight)
        # Replaced by a frame no send booked (forged, or from a runtime that lost the send): its
        # tokens cannot ride in it, so they count as left out; the syncer never crashes on a key.
        outcome = "excluded"
    return led._replace(in_flight=in_flight, dropped=_dropped_plus(led, outcome, fragment, tokens))


def merge(led: TokenLedger, keys: Iterable[MessageKey]) -> TokenLedger:
    """The contributions `keys` entered a merge."""
    for key in keys:
        led = resolve(led, key, "merged")
    return led


def die(led: TokenLedger, learner: int, incarnation: int) -> TokenLedger:
    """The incarnation died: what it processed and did not send is lost. Its messages in flight
    stay outstanding until the syncer merges or drops them (or `resolve(..., "lost")`)."""
    key = (learner, incarnation)
    row = led.pending.get(key, (0,) * led.num_fragments)
    pending = {k: v for k, v in led.pending.items() if k != key}
    return led._replace(pending=pending, lost=_plus(led.lost, row), dead=led.dead | {key})


def lose(led: TokenLedger, learner: int, incarnation: int, tokens: int) -> TokenLedger:
    """Steps of `tokens` tokens whose events were lost before the syncer read them: processed, for
    every fragment, and lost with them (nothing of theirs can be sent any more: a send named in a
    lost event is never delivered), so the equation balances."""
    if (learner, incarnation) in led.dead:
        raise LedgerError(f"learner {learner} incarnation {incarnation} is dead and cannot process")
    if tokens < 0:
        raise LedgerError(f"tokens must be >= 0, got {tokens}")
    step = (tokens,) * led.num_fragments
    return led._replace(processed=_plus(led.processed, step), lost=_plus(led.lost, step))


def outstanding(led: TokenLedger) -> tuple[int, ...]:
    out = (0,) * led.num_fragments
    for row in led.pending.values():
        out = _plus(out, row)
    for fragment, tokens in led.in_flight.values():
        out = _add(out, fragment, tokens)
    return out


def imbalance(led: TokenLedger) -> tuple[int, ...]:
    """processed_p - (merged_p + dropped_p + lost_p + outstanding_p), per fragment; all 0 when sound."""
    accounted = _plus(_plus(led.merged, led.lost), outstanding(led))
    for row in led.dropped.values():
        accounted = _plus(accounted, row)
    return tuple(a - b for a, b in zip(led.processed, accounted))


def balance(led: TokenLedger) -> int:
    """Sum over fragments of |imbalance_p|: 0 iff every fragment balances (no cancelling out)."""
    return sum(abs(x) for x in imbalance(led))


def check_balance(led: TokenLedger) -> None:
    """Raise LedgerError with every term of each fragment that does not balance."""
    bad = [p for p, x in enumerate(imbalance(led)) if x]
    if bad:
        out = outstanding(led)
        lines = [
            f"fragment {p}: processed {led.processed[p]} != merged {led.merged[p]} + dropped "
            f"{ {r: row[p] for r, row in sorted(led.dropped.items())} } + lost {led.lost[p]} + "
            f"outstanding {out[p]} (off by {imbalance(led)[p]})"
            for p in bad
        ]
        raise LedgerError("token ledger does not balance:\n" + "\n".join(lines))


def token_totals(led: TokenLedger) -> dict[str, int]:
    """Totals over fragments, as plain ints; each fragment's share is a 1/P of a token's work."""
    out = {"processed": sum(led.processed), "merged": sum(led.merged), "lost": sum(led.lost),
           "outstanding": sum(outstanding(led)), "unmatched": led.unmatched}
    out.update({f"dropped:{r}": sum(row) for r, row in sorted(led.dropped.items())})
    return out


def summary(tokens: TokenLedger, bytes_: ByteLedger, time: TimeLedger, *, start: float, end: float,
            window: float, quorum: int = 1) -> dict[str, float]:
    """Plain numbers for the run summary; windows in seconds of the runtime's clock."""
    out: dict[str, float] = {f"tokens_{k}": v for k, v in token_totals(tokens).items()}
    out["tokens_imbalance"] = balance(tokens)
    for d in DIRECTIONS:
        out[f"bytes_{d}"] = int(byte_events(bytes_, direction=d)["nbytes"].sum())
        out[f"mean_rate_{d}"] = mean_rate(bytes_, start, end, direction=d) if end > start else 0.0
        out[f"peak_rate_{d}"] = peak_rate(bytes_, window, direction=d)
    out["peak_rate_up_training"] = peak_rate(bytes_, window, skip_last=True, direction="up")
    out["goodput"] = goodput(time)
    out["uptime"] = uptime(time, quorum, start, end) if end > start else 0.0
    for m, secs in seconds(time).items():
        out.update({f"learner{m}_{s}_s": v for s, v in secs.items()})
    return out
