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
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from diloco.algo import close as closing
from diloco.algo import merge as merging
from diloco.algo import auth, bounds, hostpool, messages, outer, quorum, roundsum
from diloco.algo.codecs import Codec, NonFiniteError
from diloco.algo.eventlog import Records
from diloco.algo.fragments import Fragment, Path

Values = dict[Path, np.ndarray]


class Policy(NamedTuple):
    """How the syncer merges: quorum and grace, merge rules, outer optimizer, broadcast codec."""

    grace: quorum.GraceConfig
    outer: optax.GradientTransformation
    merge: str = "rda"  # non-embedding fragments; a name in merge.MERGES
    embedding_merge: str = "average"  # embedding fragments (section 4)
    max_staleness: int | None = None
    history: int = 16  # versions of refs kept; contributions based on older ones are stale
    down_codec: Codec | None = None  # broadcast codec for deltas; None sends fp32 values
    down_spec: str = "fp32"
    t_sync: float = 0.0  # expected pull + merge + publish time in Eq. 3 (seconds)
    # Whose step time budgets Eq. 3 [unsure]: "waiting" = the fastest learner already in the round
    # (its merged fragment is due back tau of ITS steps after sending, so K = 1 stalls nobody);
    # "slowest" = the slowest live learner, the literal reading of the paper's xi_step.
    grace_budget: str = "waiting"
    # What a contribution's pseudo-gradient is taken against [unsure]: "current" = the syncer's
    # Theta at the merge (docs/algorithm.md#merge: a stale contribution also pulls Theta back towards
    # the older copy it started from); "base" = the version it was computed from (what the learner
    # sent: only its own progress, as in asynchronous DiLoCo variants). A base that has left the
    # kept history by the merge falls back to "current".
    anchor: str = "current"
    # How far one merge moves Theta [unsure]: "admitted" = the weighted mean over the learners in
    # the merge (section 4); "live" = that mean times |admitted| / |live learners|, so each learner
    # that is absent counts as a zero delta. With anchor="base" and learners out of phase (one per
    # merge) this keeps the sum of M one-learner merges at the size of one merge of all M, where
    # "admitted" would move Theta M times as far per period (asynchronous SGD without the 1/M).
    scale: str = "admitted"
    # A poisoned or diverged learner shows as a pseudo-gradient far larger than its peers': one
    # whose norm per inner step exceeds norm_bound x the median of the fragment's last norm_window
    # admitted ones is quarantined (0 = no bound), once 8 are known. Per step, because a
    # contribution spans anything from one step (a first send, a final flush) to several H; the
    # median, not the mean, so one outlier cannot raise the bar.
    norm_bound: float = 0.0
    norm_window: int = 32
    # What a frame may claim (docs/algorithm.md#bounds-on-what-a-frame-can-claim); None = only the
    # header's own bounds. up_spec: the run's contribution codec, any other is wrong_codec. max_steps
    # bounds c_steps (the run's inner steps: c_steps counts since the last apply, so H is no bound);
    # step_tokens the tokens of one learner step: c_tokens <= c_steps x step_tokens.
    up_spec: str | None = None
    max_steps: int | None = None
    step_tokens: int | None = None
    # Armed from the first contribution: a norm per step above theta_norm_bound x (||Theta_p|| +
    # sqrt(size_p)) is quarantined (0 = off). Loose; it keeps e.g. a finite 1e30 out of the merge.
    theta_norm_bound: float = 100.0
    # The run secret when learners are authenticated (docs/algorithm.md#authenticated-learners): a
    # contribution whose tag does not verify under its learner's key is quarantined unattributed.
    auth: auth.Secret | None = None
    # Robust merge (docs/algorithm.md#robust-merges): before a merge each pseudo-gradient is scaled
    # down to at most clip x the median norm per step of the fragment's recent admitted ones (times
    # its own c_steps), so no one learner moves Theta much further than its peers; 0 = off.
    clip: float = 0.0


class Contribution(NamedTuple):
    key: tuple[int, int, int]  # (learner, incarnation, seq)
    base_version: int
    c_steps: int
    c_tokens: int
    # The learner's fragment, ref[base] - decoded delta: a roundsum.Local decoding it on demand
    # from the payload (a checkpoint saves it as arrays, and restores it as a dict).
    local: Values
    arrived: float


class FragmentState(NamedTuple):
    spec: Fragment
    theta: Values  # FP32 master copy
    outer_state: Any
    version: int
    refs: tuple[tuple[int, Values], ...]  # (version, values learners hold), oldest first
    round: quorum.Round | None = None  # open round; None until a contribution arrives
    contributions: tuple[Contribution, ...] = ()  # admitted into the open round
    norms: tuple[float, ...] = ()  # pseudo-gradient norms of the last admitted contributions
    # The open round's running sums of `contributions` (None: rebuilt from them when next needed,
    # e.g. after a checkpoint restore, which saves the contributions, not the sums).
    sums: roundsum.RoundSum | None = None
    theta_norm: float | None = None  # ||Theta||, kept with Theta (None: computed when needed)


class SyncerState(NamedTuple):
    fragments: tuple[FragmentState, ...]
    live: dict[int, int]  # learner -> live incarnation
    last_seq: dict[tuple[int, int], int]
    held: dict[int, tuple[int, ...]]  # learner -> version of each fragment it was last sent
    step_times: quorum.StepTimes = quorum.StepTimes()
    merges: int = 0
    quarantined: dict[str, int] = {}
    decisions: Records = Records()  # every decision as a plain dict, append-only (O(1) each)
    # (learner, incarnation, fragment) -> the base version of its last admitted contribution: a
    # learner applies versions in order, so its later contributions are based on no older one, and
    # older refs that no live learner can still use are freed (`_kept`, docs/design.md#syncer-memory).
    bases: dict[tuple[int, int, int], int] = {}


class SetDeadline(NamedTuple):
    fragment: int
    at: float


class Publish(NamedTuple):
    fragment: int
    version: int
    frames: dict[int, bytes]  # learner -> frame
    full: tuple[int, ...]  # learners sent a full FP32 copy; the others got the quantized delta
    merged: tuple[tuple[int, int, int], ...] = ()  # the contributions this version took in


class Outcome(NamedTuple):
    key: tuple[int, int, int] | None  # None when the frame could not even be attributed
    # "merged", "carried" (replaced by `into`, which holds its progress) or a ledger drop
    # reason ("stale", "excluded", "quarantined:<r>")
    outcome: str
    into: tuple[int, int, int] | None = None


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
        per = _rule(cfg, fs).per
        sig = (per, tuple(x.shape for _, x in _in_order(fs.theta)))
        if sig in seen:
            continue
        seen.add(sig)
        zeros = {p: np.zeros(x.shape, np.float32) for p, x in fs.theta.items()}
        gains = {p: np.float32(0.0) for p in fs.theta}
        closing.close(cfg.outer, per, zeros, gains, fs.theta, fs.outer_state, fs.refs[-1][1])


def _ref(fs: FragmentState, version: int) -> Values | None:
    return next((v for ver, v in fs.refs if ver == version), None)


def _quarantine(st: SyncerState, reason: str, key, now: float, detail: str) -> tuple[SyncerState, tuple]:
    counts = {**st.quarantined, reason: st.quarantined.get(reason, 0) + 1}
    record = {"event": "quarantine", "at": now, "reason": reason, "key": key, "detail": detail[:200]}
    outcome = "stale" if reason == "stale" else f"quarantined:{reason}"
    return st._replace(quarantined=counts, decisions=st.decisions.add(record)), (Outcome(key, outcome),)


def _with_fragment(st: SyncerState, p: int, fs: FragmentState) -> SyncerState:
    return st._replace(fragments=st.fragments[:p] + (fs,) + st.fragments[p + 1:])


def on_contribution(cfg: Policy, st: SyncerState, frame: bytes, now: float) -> tuple[SyncerState, tuple]:
    """Validate, decode and admit one contribution frame; merge if the round's decision says so."""
    try:
        msg = messages.decode(frame, max_payload=max_payload(st), verify=False)
    except messages.MessageError as e:
        return _quarantine(st, e.reason, None, now, e.detail)
    # The payload's checksum (a blake2b tree, its pieces on the pool's threads) is summed while
    # the payload is decoded. Nothing is admitted before it passes, and a frame that fails it is
    # quarantined from `st` whatever else was found: the outcomes of checking it first.
    verified = hostpool.start(lambda: messages.payload_fault(msg), len(msg.payload) >= hostpool.CHUNK)
    out = _received(cfg, st, msg, now, verified)
    fault = verified()
    if fault is not None:
        return _quarantine(st, fault.reason, None, now, fault.detail)
    return out


def _received(cfg: Policy, st: SyncerState, msg: messages.Message, now: float,
              verified) -> tuple[SyncerState, tuple]:
    h = msg.header
    if cfg.auth is not None:
        why = auth.verify(cfg.auth, h, msg.payload)
        if why:  # nothing its header says is believed, its key least of all
            return _quarantine(st, "unauthenticated", None, now, why)
    key = (h["learner"], h["incarnation"], h["seq"])
    p = h["fragment"]
    version = st.fragments[p].version if 0 <= p < len(st.fragments) else 0
    reason = messages.check_admission(h, st.live, st.last_seq, version, cfg.max_staleness,
                                      num_fragments=len(st.fragments), max_steps=cfg.max_steps,
                                      step_tokens=cfg.step_tokens)
    if reason == "bad_counter":
        return _quarantine(st, reason, key, now, f"c_steps {h['c_steps']} (at most {cfg.max_steps}), "
                           f"c_tokens {h['c_tokens']} (at most {cfg.step_tokens} per step)")
    if reason == "duplicate":  # its key is an earlier frame's, maybe in the open round: not this one's to book
        return _quarantine(st, reason, None, now, f"seq {h['seq']} <= {st.last_seq[(key[0], key[1])]} of "
                           f"learner {key[0]} incarnation {key[1]}")
    if reason is not None:
        return _quarantine(st, reason, key, now, f"fragment {p} base {h['base_version']} now {version}")
    if cfg.up_spec is not None and h["codec"] != cfg.up_spec:  # before decoding allocates anything
        return _quarantine(st, "wrong_codec", key, now, f"codec {h['codec']!r}, this run sends {cfg.up_spec!r}")
    fs = st.fragments[p]
    ref = _ref(fs, h["base_version"])
    if ref is None:  # older than the kept history: cannot be decoded against what the learner held
        return _quarantine(st, "stale", key, now, f"base version {h['base_version']} not in history")
    expected = {path: (x.shape, np.float32) for path, x in fs.theta.items()}
    try:
        wire = messages.unpack_fragment(h, msg.payload, None, expected)
    except messages.MessageError as e:
        return _quarantine(st, e.reason, key, now, e.detail)
    # The pseudo-gradient against this round's anchor, written over the decoded payload, and both
    # norms, in one pass; kept only if the contribution is admitted into this round.
    anchor = _anchor(cfg, fs, h["base_version"])
    deltas, wire_norms, delta_norms = [], [], []
    for path in fs.theta:
        d, nw, nd = roundsum.delta(anchor[path], ref[path], roundsum.owned(wire[path]))
        deltas.append(d)
        wire_norms.append(nw)
        delta_norms.append(nd)
    norm = math.sqrt(math.fsum(n * n for n in wire_norms)) / max(h["c_steps"], 1)  # finite for any float32 payload
    why = bounds.norm_fault(norm, fs.norms, cfg.norm_bound, _theta_norm(fs),
                            sum(x.size for x in fs.theta.values()), cfg.theta_norm_bound)
    if why:
        return _quarantine(st, "exploding_norm", key, now, why)
    if verified() is not None:  # on_contribution quarantines it
        return st, ()
    if norm > 0:  # zeros stay out: a median of zeros would refuse every nonzero contribution
        st = _with_fragment(st, p, fs._replace(norms=(fs.norms + (norm,))[-cfg.norm_window:]))
    st = st._replace(last_seq={**st.last_seq, (h["learner"], h["incarnation"]): h["seq"]},
                     bases={**st.bases, (*key[:2], p): h["base_version"]})
    local = roundsum.local(ref, h, msg.payload)
    contribution = Contribution(key, h["base_version"], h["c_steps"], h["c_tokens"], local, now)
    return _admit(cfg, st, p, contribution, now, (deltas, tuple(delta_norms)))


def _theta_norm(fs: FragmentState) -> float:
    return fs.theta_norm if fs.theta_norm is not None else merging.global_norm(fs.theta)


def _admit(cfg: Policy, st: SyncerState, p: int, c: Contribution, now: float,
           prepared: tuple[list, tuple[float, ...]] | None = None) -> tuple[SyncerState, tuple]:
    """`prepared`: c's deltas and norms against the anchor of the round open at its arrival; a
    late contribution goes into the next round, whose anchor may differ, and is prepared again."""
    fs = st.fragments[p]
    rnd = fs.round or quorum.open_round(p, now, st.live)
    step_time = _budget_step_time(cfg, st, {m for m, _ in rnd.arrivals} | {c.key[0]})
    rnd, decision = quorum.on_arrival(rnd, cfg.grace, c.key[0], now, step_time, cfg.t_sync)
    actions: tuple = ()
    if decision.reason == quorum.REPEAT:  # the newer contribution of the same learner replaces the older
        old = [x for x in fs.contributions if x.key[0] == c.key[0]]
        kept = tuple(x for x in fs.contributions if x.key[0] != c.key[0]) + (c,)
        # Of the same incarnation and against the same base, the newer one is the older plus later
        # steps (the learner applied nothing in between), so the older one's tokens ride in it;
        # otherwise (another base, or a restarted learner's first frame) they are lost.
        actions += tuple(Outcome(x.key, "carried", c.key)
                         if x.base_version == c.base_version and x.key[1] == c.key[1]
                         else Outcome(x.key, "excluded") for x in old)
        # The older one leaves the sums: they are rebuilt from the payloads kept (rare: a learner
        # sent twice within one open round), never by subtraction, which would not be exact.
        fs = fs._replace(round=rnd, contributions=kept, sums=None)
    elif decision.action == quorum.MERGE and c.key[0] in decision.late:
        fs = fs._replace(round=rnd)  # the late one goes into the next round, after this merge
    else:
        rs = _sums(cfg, fs, fs.contributions)
        deltas, norms = prepared if prepared is not None else _prepare(cfg, fs, c)
        rs = roundsum.fold(rs, c.key, merging.token_weight(c.c_tokens, c.c_steps), deltas, norms, _rule(cfg, fs))
        fs = fs._replace(round=rnd, contributions=fs.contributions + (c,), sums=rs)
    st = _with_fragment(st, p, fs)
    st = st._replace(decisions=st.decisions.add(_record("arrival", decision, c)))
    if decision.action == quorum.QUORUM:
        return st, actions + (SetDeadline(p, decision.deadline),)
    if decision.action == quorum.MERGE:
        st, merged = _merge(cfg, st, p, decision, now)
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
    st = _with_fragment(st, p, fs._replace(round=rnd))
    if decision.action != quorum.MERGE:
        return st, ()
    return _merge(cfg, st, p, decision, now)


def on_live_change(cfg: Policy, st: SyncerState, live: dict[int, int], now: float) -> tuple[SyncerState, tuple]:
    """Learners died or joined (`live`: learner -> incarnation). A joiner is held at no version
    (-1) so its next broadcast is a full copy. Open rounds are re-evaluated: a death may complete one."""
    held = {m: st.held.get(m, (-1,) * len(st.fragments)) for m in live}
    for m, inc in live.items():
        if m in st.live and inc != st.live[m]:
            held[m] = (-1,) * len(st.fragments)
    bases = {k: v for k, v in st.bases.items() if live.get(k[0]) == k[1]}  # a joiner's stay unknown
    st = st._replace(live=dict(live), held=held, bases=bases)
    actions: tuple = ()
    for p, fs in enumerate(st.fragments):
        if fs.round is None:
            continue
        step_time = _budget_step_time(cfg, st, {m for m, _ in fs.round.arrivals})
        rnd, decision = quorum.on_live_change(fs.round, cfg.grace, live, now, step_time, cfg.t_sync)
        st = _with_fragment(st, p, fs._replace(round=rnd))
        if decision.action == quorum.MERGE:
            st, more = _merge(cfg, st, p, decision, now)
            actions += more
        elif decision.action == quorum.QUORUM:
            actions += (SetDeadline(p, decision.deadline),)
    return st, actions


def _budget_step_time(cfg: Policy, st: SyncerState, waiting: set[int]) -> float:
    if cfg.grace_budget == "slowest":
        return quorum.slowest_step_time(st.step_times, st.live)
    known = [s for m, s in st.step_times.estimates if m in waiting]
    return min(known, default=0.0)


def observe_step_time(st: SyncerState, learner: int, seconds: float) -> SyncerState:
    return st._replace(step_times=quorum.observe_step_time(st.step_times, learner, seconds))


def _rule(cfg: Policy, fs: FragmentState) -> merging.MergeRule:
    """fs's merge rule, read from the registry (merge.MERGES) each time it is needed."""
    return merging.rule(cfg.embedding_merge if fs.spec.embedding else cfg.merge)


def _prepare(cfg: Policy, fs: FragmentState, c: Contribution) -> tuple[list, tuple[float, ...]]:
    """c's deltas (fresh arrays, path order) against the anchor of fs's round, and their norms."""
    anchor = _anchor(cfg, fs, c.base_version)
    deltas, norms = [], []
    for path in fs.theta:
        if isinstance(c.local, roundsum.Local):  # the same arithmetic as at its arrival, bit for bit
            d, _, n = roundsum.delta(anchor[path], c.local.ref[path], c.local.wire(path))
        else:  # restored from a checkpoint as local values: anchor - local, the same bits again
            d, n = roundsum.delta_of_local(anchor[path], c.local[path])
        deltas.append(d)
        norms.append(n)
    return deltas, tuple(norms)


def _sums(cfg: Policy, fs: FragmentState, inside, scales=None) -> roundsum.RoundSum:
    """The running sums of `inside`: fs.sums when they are exactly those, else rebuilt by folding
    them again in order (REPEAT, overflow, clipped averages, a restored checkpoint: all rare)."""
    keys = tuple(c.key for c in inside)
    if scales is None and fs.sums is not None and fs.sums.keys == keys:
        return fs.sums
    rule = _rule(cfg, fs)
    rs = roundsum.empty(fs.theta)
    for i, c in enumerate(inside):
        deltas, norms = _prepare(cfg, fs, c)
        rs = roundsum.fold(rs, c.key, merging.token_weight(c.c_tokens, c.c_steps), deltas, norms, rule,
                           1.0 if scales is None else scales[i])
    return rs


def _merge(cfg: Policy, st: SyncerState, p: int, decision: quorum.Decision,
           now: float) -> tuple[SyncerState, tuple]:
    fs = st.fragments[p]
    inside = [c for c in fs.contributions if c.key[0] in decision.admitted]
    rs = _sums(cfg, fs, inside)
    fs = fs._replace(round=None, contributions=(), sums=None)
    st = _with_fragment(st, p, fs)
    rule = _rule(cfg, fs)
    scales, clipped = _clipped(cfg, fs, inside, rs)
    if rule.clip_rebuilds and clipped:  # a clipped delta is in the sum whole: sum again, scaled
        rs = _sums(cfg, fs, inside, scales)
    dropped: tuple = ()
    while True:
        weights = [merging.token_weight(c.c_tokens, c.c_steps) for c in inside]
        if not inside or sum(weights) <= 0:  # nothing with weight: no step, nothing published
            return st, dropped + tuple(Outcome(c.key, "excluded") for c in inside)
        stepped = _step(cfg, st, fs, p, rs, weights, scales, rule, tuple(c.key for c in inside))
        if stepped is not None:
            break
        # Non-finite: drop the largest pseudo-gradient (every one was finite, so only size can
        # overflow) and merge the rest; Theta, its optimizer state and the version stay as they were.
        worst = max(range(len(inside)), key=lambda i: scales[i] * rs.parts[i].norm)
        c = inside.pop(worst)
        del scales[worst]
        rs = _sums(cfg, fs, inside, scales if rule.clip_rebuilds else None)
        st, quarantined = _quarantine(st, "overflow", c.key, now, f"merging it into fragment {p} "
                                      f"version {fs.version + 1} would make Theta non-finite")
        dropped += quarantined
    st, publish, delta_norm = stepped
    record = {
        **_record("merge", decision, None), "version": fs.version + 1, "method": rule.name,
        "learners": [c.key[0] for c in inside], "weights": weights,
        "staleness": [fs.version - c.base_version for c in inside],
        "delta_norm": delta_norm, "clipped": [c.key[0] for c in inside if c.key in clipped],
    }
    st = st._replace(merges=st.merges + 1, decisions=st.decisions.add(record))
    return st, dropped + (publish,) + tuple(Outcome(c.key, "merged") for c in inside)


def _clipped(cfg: Policy, fs: FragmentState, inside: list[Contribution],
             rs: roundsum.RoundSum) -> tuple[list[float], set[tuple[int, int, int]]]:
    """Each delta's clip factor: with norm per step above cfg.clip x the median of the fragment's
    recent nonzero ones it is scaled down onto that bar (direction kept); and the keys scaled."""
    recent = [n for n in fs.norms if n > 0]
    scales = [1.0] * len(inside)
    if cfg.clip <= 0 or not recent:
        return scales, set()
    bar = cfg.clip * float(np.median(recent))
    clipped = set()
    for i, (c, part) in enumerate(zip(inside, rs.parts)):
        allowed = bar * max(c.c_steps, 1)
        if part.norm > allowed:
            scales[i] = float(np.float32(allowed / part.norm))  # the float32 factor a delta was scaled by
            clipped.add(c.key)
    return scales, clipped


def _step(cfg: Policy, st: SyncerState, fs: FragmentState, p: int, rs: roundsum.RoundSum,
          weights: list[float], scales: list[float], rule: merging.MergeRule,
          keys: tuple[tuple[int, int, int], ...]) -> tuple[SyncerState, Publish, float] | None:
    """Merge, take the outer step and publish; None if anything published or kept would be
    non-finite (an encoder would refuse it, and a non-finite Theta never recovers)."""
    if not all(math.isfinite(part.norm) for part in rs.parts):  # a delta overflowed float32 itself
        return None
    live = len(keys) / len(st.live) if cfg.scale == "live" and len(keys) < len(st.live) else 1.0
    gains = [g * live for g in rule.gains(weights, scales, [part.norms for part in rs.parts], rs.scales)]
    sums = {path: (s if s is not None else np.zeros(x.shape, np.float32))
            for (path, x), s in zip(fs.theta.items(), rs.sums)}
    with np.errstate(over="ignore"):  # a gain past float32 is inf: non-finite, refused below
        gains = {path: np.float32(g) for path, g in zip(fs.theta, gains)}
    done = closing.close(cfg.outer, rule.per, sums, gains, fs.theta, fs.outer_state, fs.refs[-1][1])
    if not done.finite:
        return None
    fs = fs._replace(theta=done.theta, outer_state=jax.tree.map(np.asarray, done.outer_state),
                     version=fs.version + 1, theta_norm=done.theta_norm)
    try:
        st, publish = _publish(cfg, st, fs, p, keys, done.diff)
    except (NonFiniteError, messages.MessageError):  # the broadcast codec's rounding overflowed
        return None
    return st, publish, done.delta_norm


def _in_order(tree: Values) -> list[tuple[Path, Any]]:
    """A fragment's {path: array} in sorted path order, the order jax flattens a dict in, so the
    leaves of an optimizer state over the dict line up with those over the tuple of arrays."""
    return sorted(tree.items(), key=lambda kv: kv[0])


def _anchor(cfg: Policy, fs: FragmentState, base_version: int) -> Values:
    if cfg.anchor == "base":
        ref = _ref(fs, base_version)
        if ref is not None:
            return ref
    return fs.theta


def _publish(cfg: Policy, st: SyncerState, fs: FragmentState, p: int,
             merged: tuple[tuple[int, int, int], ...], diff: Values) -> tuple[SyncerState, Publish]:
    """New ref = old ref + decode(encode(Theta - old ref)) (`diff` = Theta - old ref); learners
    holding the previous version get that delta, others (joiners, learners that missed a version)
    a full FP32 copy, built only if one of them needs it."""
    prev_version, prev = fs.refs[-1]
    if cfg.down_codec is None:
        ref, delta_frame = fs.theta, None
    else:
        tensors, payload, _ = messages.pack_fragment(diff, cfg.down_codec)
        # the frame (its checksum) is built on a pool thread while the new ref is decoded and summed
        framed = hostpool.start(lambda: _frame(p, fs.version, prev_version, cfg.down_spec, tensors, payload,
                                               merged), len(payload) >= hostpool.CHUNK)
        decoded = messages.unpack_fragment({"codec": cfg.down_spec, "tensors": tensors}, payload,
                                           cfg.down_codec, {k: (v.shape, np.float32) for k, v in prev.items()})
        ref = {path: roundsum.add_into(prev[path], decoded[path]) for path in prev}
        delta_frame = framed()
    full_copy = None
    frames, full = {}, []
    held = dict(st.held)
    for m in sorted(st.live):
        versions = held.get(m, (-1,) * len(st.fragments))
        if delta_frame is not None and versions[p] == prev_version:
            frames[m] = delta_frame
        else:
            if full_copy is None:
                tensors, payload, _ = messages.pack_fragment(ref, messages.codec_from_spec("fp32"))
                full_copy = _frame(p, fs.version, None, "fp32", tensors, payload, merged)
            frames[m] = full_copy
            full.append(m)
        held[m] = versions[:p] + (fs.version,) + versions[p + 1:]
    refs = _kept(st, fs, p, (fs.refs + ((fs.version, ref),))[-cfg.history:])
    st = _with_fragment(st, p, fs._replace(refs=refs))
    return st._replace(held=held), Publish(p, fs.version, frames, tuple(full), merged)


def _kept(st: SyncerState, fs: FragmentState, p: int, refs: tuple) -> tuple:
    """Of fragment p's `refs` (newest last, always kept), those a contribution may still be based
    on: none older than the oldest base of the open round's contributions or of any live learner's
    last one. A live learner with no admitted contribution yet (a joiner) keeps them all, up to
    Policy.history (docs/design.md#syncer-memory)."""
    floor = min((c.base_version for c in fs.contributions), default=refs[-1][0])
    for m, inc in st.live.items():
        base = st.bases.get((m, inc, p))
        if base is None:
            return refs
        floor = min(floor, base)
    return tuple(r for r in refs[:-1] if r[0] >= floor) + refs[-1:]


def _frame(p: int, version: int, delta_against: int | None, spec: str, tensors, payload: bytes,
           merged: tuple[tuple[int, int, int], ...] = ()) -> bytes:
    header = {"kind": "fragment", "learner": 0, "incarnation": 0, "seq": version, "fragment": p,
              "base_version": delta_against if delta_against is not None else version,
              "version": version, "c_steps": 0, "c_tokens": 0, "codec": spec,
              "delta_against": delta_against, "tensors": tensors, "merged": [list(k) for k in merged]}
    return messages.encode(header, payload)


def full_frame(st: SyncerState, p: int, merged: tuple[tuple[int, int, int], ...] = ()) -> bytes:
    """Fragment p's current ref as a full FP32 frame (a joiner's start, or a catch-up copy for a
    learner whose queued deltas were collapsed; `merged` then lists what those deltas answered)."""
    version, ref = st.fragments[p].refs[-1]
    tensors, payload, _ = messages.pack_fragment(ref, messages.codec_from_spec("fp32"))
    return _frame(p, version, None, "fp32", tensors, payload, merged)


def full_frames(st: SyncerState) -> dict[int, bytes]:
    """Every fragment's current ref as a full FP32 frame: what a joining learner starts from."""
    return {p: full_frame(st, p) for p in range(len(st.fragments))}


def max_payload(st: SyncerState) -> int:
    """The largest payload a contribution of any fragment of `st` can honestly have, in bytes."""
    # Per tensor of n values no codec sends more than top-k at fraction 1 (a uint32 index and a
    # float32 value each: 8n, twice fp32), and zstd adds at most n/32 of that plus 64 bytes and a
    # 22-byte frame header and checksum (ZSTD_COMPRESSBOUND); a larger payload is hostile.
    return max(sum(8 * x.size + x.size // 32 + 96 for x in fs.theta.values()) for fs in st.fragments)


def _record(event: str, d: quorum.Decision, c: Contribution | None) -> dict:
    r = {"event": event, "at": d.at, "fragment": d.fragment, "action": d.action, "reason": d.reason,
         "admitted": list(d.admitted), "missing": list(d.missing), "late": list(d.late),
         "quorum": d.quorum, "t_quorum": d.t_quorum, "grace": d.grace}
    if c is not None:
        r.update(key=list(c.key), base_version=c.base_version, c_steps=c.c_steps, c_tokens=c.c_tokens)
    return r


def theta(st: SyncerState) -> dict[Path, np.ndarray]:
    """The global model, all fragments, keyed by path."""
    return {path: x for fs in st.fragments for path, x in fs.theta.items()}


