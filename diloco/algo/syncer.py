"""The syncer state machine: admit contributions, merge a quorum per fragment round with token
weights, step the outer optimizer and publish the new version (docs/algorithm.md#syncer).

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), sections 3-5.

The state is a value; every event returns a new state and a tuple of actions for the runtime:
`SetDeadline` (arm a grace timer), `Publish` (frames to deliver, one per learner) and `Outcome`
(what became of each contribution, for the token ledger). Every decision is also appended to the
decision records as plain dicts. No threads, clocks or files: `now` is passed in.

Broadcasts carry a quantized delta against the version the learner holds, so the syncer keeps, per
fragment, the values learners reconstruct ("refs") for the last `history` versions: a contribution
is decoded against the ref of its base version, and a broadcast's rounding error is carried into
the next delta instead of accumulating.

A round keeps no fp32 copy per contribution: each admitted one is decoded straight into the round's
running sum (diloco/algo/roundsum.py) and keeps only its payload, so closing a round is one jitted
pass (merge, outer step, broadcast delta, finiteness; diloco/algo/close.py), run in pieces on every
core and compiled at `init`.

This module holds the events and the admission of a contribution; the state and action types are
in diloco/algo/syncer_state.py, the round's close in diloco/algo/syncer_merge.py and publishing in
diloco/algo/syncer_publish.py.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from diloco.algo import close as closing
from diloco.algo import merge as merging
from diloco.algo import auth, bounds, claims, codec_specs, hostpool, messages, payloads, quorum, roundsum
from diloco.algo import syncer_publish as publishing
from diloco.algo.fragments import Fragment, Path
from diloco.algo.syncer_merge import merge_round, prepare, round_sums, summed
# The state, policy and actions are this state machine's API: callers read them here (sync.Policy,
# sync.Publish, ...), so they are named in this import even where this module does not use them.
from diloco.algo.syncer_state import (  # noqa: F401
    Contribution, FragmentState, Outcome, Policy, Publish, SetDeadline, SyncerState, Values, anchor_of,
    decision_record, expected, in_order, measures, merge_rule, quarantine, ref_of, theta_norm_of, with_fragment,
)


def init(cfg: Policy, fragments: tuple[Fragment, ...], values: tuple[Values, ...],
         learners: dict[int, int], merges: bool = True) -> SyncerState:
    """Theta_0 = `values` (the learners start from exactly these), version 0 everywhere.
    `merges`: compile the merges now (compile_merges); False where the state is only read, as a
    learner reads its references, and never merged."""
    frags = []
    for spec, v in zip(fragments, values):
        theta = {p: np.asarray(x, np.float32) for p, x in v.items()}
        state = jax.tree.map(np.asarray, cfg.outer.init(theta))
        frags.append(FragmentState(spec, theta, state, 0, ((0, theta),), theta_norm=merging.global_norm(theta)))
    st = SyncerState(tuple(frags), dict(learners), {}, held={m: (0,) * len(fragments) for m in learners},
                     bases={(m, inc, p): 0 for m, inc in learners.items() for p in range(len(fragments))})
    if merges:
        compile_merges(cfg, st)
    return st


def compile_merges(cfg: Policy, st: SyncerState) -> None:
    """Compile the close of every fragment shape now, not in its first round. The close takes the
    round's sums as leaves in path order, not keyed by path, so fragments of equal shapes (every
    middle block of a transformer) share one executable, and any number of contributors uses it.
    Runs each shape once on zeros (the result is dropped; jit caches the executable)."""
    seen = set()
    for fs in st.fragments:
        per = merge_rule(cfg, fs).per
        sig = (per, tuple(x.shape for _, x in in_order(fs.theta)))
        if sig in seen:
            continue
        seen.add(sig)
        zeros = {p: np.zeros(x.shape, np.float32) for p, x in fs.theta.items()}
        gains = {p: np.float32(0.0) for p in fs.theta}
        closing.close(cfg.outer, per, zeros, gains, fs.theta, fs.outer_state, fs.refs[-1][1], stats=measures(cfg))


def on_contribution(cfg: Policy, st: SyncerState, frame: bytes, now: float) -> tuple[SyncerState, tuple]:
    """Validate, decode and admit one contribution frame; merge if the round's decision says so."""
    try:
        msg = messages.decode(frame, max_payload=max_payload(st), verify=False)
    except messages.MessageError as e:
        return quarantine(st, e.reason, None, now, e.detail)
    # The payload's checksum (a blake2b tree, its pieces on the pool's threads) is summed while
    # the payload is decoded. Nothing is admitted before it passes, and a frame that fails it is
    # quarantined from `st` whatever else was found: the outcomes of checking it first.
    verified = hostpool.start(lambda: messages.payload_fault(msg), len(msg.payload) >= hostpool.CHUNK)
    out = _received(cfg, st, msg, now, verified)
    fault = verified()
    if fault is not None:
        return quarantine(st, fault.reason, None, now, fault.detail)
    return out


def _received(cfg: Policy, st: SyncerState, msg: messages.Message, now: float,
              verified) -> tuple[SyncerState, tuple]:
    h = msg.header
    if cfg.auth is not None:
        why = auth.verify(cfg.auth, h, msg.payload)
        if why:  # nothing its header says is believed, its key least of all
            return quarantine(st, "unauthenticated", None, now, why)
    key = (h["learner"], h["incarnation"], h["seq"])
    p = h["fragment"]
    version = st.fragments[p].version if 0 <= p < len(st.fragments) else 0
    reason = messages.check_admission(h, st.live, st.last_seq, version, cfg.max_staleness,
                                      num_fragments=len(st.fragments), max_steps=cfg.max_steps,
                                      step_tokens=cfg.step_tokens)
    if reason == "bad_counter":
        return quarantine(st, reason, key, now, f"c_steps {h['c_steps']} (at most {cfg.max_steps}), "
                           f"c_tokens {h['c_tokens']} (at most {cfg.step_tokens} per step)")
    if reason == "duplicate":  # its key is an earlier frame's, maybe in the open round: not this one's to book
        return quarantine(st, reason, None, now, f"seq {h['seq']} <= {st.last_seq[(key[0], key[1])]} of "
                           f"learner {key[0]} incarnation {key[1]}")
    if reason is not None:
        return quarantine(st, reason, key, now, f"fragment {p} base {h['base_version']} now {version}")
    if cfg.claim_slack is not None:  # what the header claims against what the syncer saw (claims.py)
        why = claims.excess(st.claims, *key[:2], p, h["c_steps"], cfg.grace.tau + cfg.claim_slack)
        if why:
            return quarantine(st, "bad_counter", key, now, why)
    if cfg.up_spec is not None and h["codec"] != cfg.up_spec:  # before decoding allocates anything
        return quarantine(st, "wrong_codec", key, now, f"codec {h['codec']!r}, this run sends {cfg.up_spec!r}")
    fs = st.fragments[p]
    ref = ref_of(fs, h["base_version"])
    if ref is None:  # older than the kept history: cannot be decoded against what the learner held
        return quarantine(st, "stale", key, now, f"base version {h['base_version']} not in history")
    expected = {path: (x.shape, np.float32) for path, x in fs.theta.items()}
    try:
        wire = payloads.unpack_fragment(h, msg.payload, None, expected)
    except messages.MessageError as e:
        return quarantine(st, e.reason, key, now, e.detail)
    # The pseudo-gradient against this round's anchor, written over the decoded payload, and both
    # norms, in one pass; kept only if the contribution is admitted into this round.
    anchor = anchor_of(cfg, fs, h["base_version"])
    deltas, wire_norms, delta_norms = [], [], []
    for path in fs.theta:
        d, nw, nd = roundsum.delta(anchor[path], ref[path], roundsum.owned(wire[path]))
        deltas.append(d)
        wire_norms.append(nw)
        delta_norms.append(nd)
    norm = math.sqrt(math.fsum(n * n for n in wire_norms)) / max(h["c_steps"], 1)  # finite for any float32 payload
    why = bounds.norm_fault(norm, fs.norms, cfg.norm_bound, theta_norm_of(fs),
                            sum(x.size for x in fs.theta.values()), cfg.theta_norm_bound)
    if why:
        return quarantine(st, "exploding_norm", key, now, why)
    if verified() is not None:  # on_contribution quarantines it
        return st, ()
    if norm > 0:  # zeros stay out: a median of zeros would refuse every nonzero contribution
        st = with_fragment(st, p, fs._replace(norms=(fs.norms + (norm,))[-cfg.norm_window:]))
    st = st._replace(last_seq={**st.last_seq, (h["learner"], h["incarnation"]): h["seq"]},
                     bases={**st.bases, (*key[:2], p): h["base_version"]},
                     claims=claims.admitted(st.claims, *key[:2], p))
    local = roundsum.local(ref, h, msg.payload)
    contribution = Contribution(key, h["base_version"], h["c_steps"], h["c_tokens"], local, now)
    return _admit(cfg, st, p, contribution, now, (deltas, tuple(delta_norms)))


def _admit(cfg: Policy, st: SyncerState, p: int, c: Contribution, now: float,
           prepared: tuple[list, tuple[float, ...]] | None = None) -> tuple[SyncerState, tuple]:
    """`prepared`: c's deltas and norms against the anchor of the round open at its arrival; a
    late contribution goes into the next round, whose anchor may differ, and is prepared again."""
    fs = st.fragments[p]
    rnd = fs.round or quorum.open_round(p, now, expected(st))
    step_time = _budget_step_time(cfg, st, {m for m, _ in rnd.arrivals} | {c.key[0]})
    rnd, decision = quorum.on_arrival(rnd, cfg.grace, c.key[0], now, step_time, cfg.t_sync)
    actions: tuple = ()
    if decision.reason == quorum.REPEAT:  # the newer contribution of the same learner replaces the older
        old = [x for x in fs.contributions if x.key[0] == c.key[0]]
        # Of the same incarnation and against the same base, the newer one is the older plus later
        # steps (the learner applied nothing in between), so the older one's tokens ride in it;
        # otherwise (another base, or a restarted learner's first frame) they are lost. An eager
        # learner's newer one holds only the progress since its older one's send: the two are added
        # (syncer_merge.summed), and the older one's tokens ride in the sum.
        if cfg.eager and len(old) == 1 and old[0].key[1] == c.key[1]:
            c = summed(cfg, fs, old[0], c)
        kept = tuple(x for x in fs.contributions if x.key[0] != c.key[0]) + (c,)
        actions += tuple(Outcome(x.key, "carried", c.key)
                         if (x.base_version == c.base_version or cfg.eager) and x.key[1] == c.key[1]
                         else Outcome(x.key, "excluded") for x in old)
        # The older one leaves the sums: they are rebuilt from the payloads kept (rare: a learner
        # sent twice within one open round), never by subtraction, which would not be exact.
        fs = fs._replace(round=rnd, contributions=kept, sums=None)
    elif decision.action == quorum.MERGE and c.key[0] in decision.late:
        fs = fs._replace(round=rnd)  # the late one goes into the next round, after this merge
    else:
        rs = round_sums(cfg, fs, fs.contributions)
        deltas, norms = prepared if prepared is not None else prepare(cfg, fs, c)
        rs = roundsum.fold(rs, c.key, merging.token_weight(c.c_tokens, c.c_steps), deltas, norms, merge_rule(cfg, fs))
        fs = fs._replace(round=rnd, contributions=fs.contributions + (c,), sums=rs)
    st = with_fragment(st, p, fs)
    st = st._replace(decisions=st.decisions.add(decision_record("arrival", decision, c)))
    if decision.action == quorum.QUORUM:
        return st, actions + (SetDeadline(p, decision.deadline),)
    if decision.action == quorum.MERGE:
        st, merged = merge_round(cfg, st, p, decision, now)
        actions += merged
        if c.key[0] in decision.late:
            st, more = _admit(cfg, st, p, c, now)
            actions += more
    return st, actions


def on_deadline(cfg: Policy, st: SyncerState, p: int, now: float) -> tuple[SyncerState, tuple]:
    fs = st.fragments[p]
    if fs.round is None:
        return st, ()
    rnd, decision = quorum.on_deadline(fs.round, cfg.grace, now)
    st = with_fragment(st, p, fs._replace(round=rnd))
    if decision.action != quorum.MERGE:
        return st, ()
    return merge_round(cfg, st, p, decision, now)


def on_live_change(cfg: Policy, st: SyncerState, live: dict[int, int], now: float) -> tuple[SyncerState, tuple]:
    """Learners died or joined (`live`: learner -> incarnation). A joiner is held at no version
    (-1) so its next broadcast is a full copy. Open rounds are re-evaluated: a death may complete one."""
    held = {m: st.held.get(m, (-1,) * len(st.fragments)) for m in live}
    for m, inc in live.items():
        if m in st.live and inc != st.live[m]:
            held[m] = (-1,) * len(st.fragments)
    bases = {k: v for k, v in st.bases.items() if live.get(k[0]) == k[1]}  # a joiner's stay unknown
    finished = tuple(m for m in st.finished if live.get(m) == st.live.get(m))  # a new incarnation trains
    st = st._replace(live=dict(live), held=held, bases=bases, claims=claims.on_live(st.claims, live, st.live),
                     finished=finished)
    return _reevaluate(cfg, st, now)


def on_finished(cfg: Policy, st: SyncerState, learner: int, incarnation: int,
                now: float) -> tuple[SyncerState, tuple]:
    """Learner `learner` (incarnation `incarnation`) finished training and every contribution it
    sent has been delivered: open rounds stop waiting for it (`expected`), which may complete them.
    Ignored for an incarnation that is not the live one, or a learner already finished."""
    if st.live.get(learner) != incarnation or learner in st.finished:
        return st, ()
    return _reevaluate(cfg, st._replace(finished=tuple(sorted(st.finished + (learner,)))), now)


def _reevaluate(cfg: Policy, st: SyncerState, now: float) -> tuple[SyncerState, tuple]:
    """Every open round against the learners it now waits for."""
    actions: tuple = ()
    for p, fs in enumerate(st.fragments):
        if fs.round is None:
            continue
        waiting = {m for m, _ in fs.round.arrivals}
        step_time = _budget_step_time(cfg, st, waiting)
        rnd, decision = quorum.on_live_change(fs.round, cfg.grace, expected(st, waiting), now, step_time, cfg.t_sync)
        st = with_fragment(st, p, fs._replace(round=rnd))
        if decision.action == quorum.MERGE:
            st, more = merge_round(cfg, st, p, decision, now)
            actions += more
        elif decision.action == quorum.QUORUM:
            actions += (SetDeadline(p, decision.deadline),)
    return st, actions


def _budget_step_time(cfg: Policy, st: SyncerState, waiting: set[int]) -> float:
    if cfg.grace_budget == "slowest":
        return quorum.slowest_step_time(st.step_times, expected(st, waiting))
    known = [s for m, s in st.step_times.estimates if m in waiting]
    return min(known, default=0.0)


def observe_step_time(st: SyncerState, learner: int, seconds: float) -> SyncerState:
    """A step of `learner` took `seconds`: its step time for Eq. 3, and one step its claims may count."""
    return st._replace(step_times=quorum.observe_step_time(st.step_times, learner, seconds),
                       claims=claims.observe_step(st.claims, learner))


def full_frame(st: SyncerState, p: int, merged: tuple[tuple[int, int, int], ...] = ()) -> bytes:
    """Fragment p's current ref as a full FP32 frame (a joiner's start, or a catch-up copy for a
    learner whose queued deltas were collapsed; `merged` then lists what those deltas answered)."""
    version, ref = st.fragments[p].refs[-1]
    tensors, payload, _ = payloads.pack_fragment(ref, codec_specs.codec_from_spec("fp32"))
    return publishing.frame(p, version, None, "fp32", tensors, payload, merged)


def full_frames(st: SyncerState) -> dict[int, bytes]:
    """Every fragment's current ref as a full FP32 frame: what a joining learner starts from."""
    return {p: full_frame(st, p) for p in range(len(st.fragments))}


def max_payload(st: SyncerState) -> int:
    """The largest payload a contribution of any fragment of `st` can honestly have, in bytes."""
    return max_payload_of(tuple(fs.theta for fs in st.fragments))


def max_payload_of(fragments: tuple[Values, ...]) -> int:
    """max_payload of fragments given as path -> array (or ShapeDtypeStruct: only sizes count)."""
    # Per tensor of n values no codec sends more than top-k at fraction 1 (a uint32 index and a
    # float32 value each: 8n, twice fp32), and zstd adds at most n/32 of that plus 64 bytes and a
    # 22-byte frame header and checksum (ZSTD_COMPRESSBOUND); a larger payload is hostile.
    return max(sum(8 * x.size + x.size // 32 + 96 for x in values.values()) for values in fragments)


def theta(st: SyncerState) -> dict[Path, np.ndarray]:
    """The global model, all fragments, keyed by path."""
    return {path: x for fs in st.fragments for path, x in fs.theta.items()}
