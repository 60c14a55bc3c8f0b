"""The syncer's state and actions, as values (docs/algorithm.md#syncer): the merge policy, each
fragment's state and the contributions of its open round, the actions an event returns, and the
small reads and updates of them that admission (diloco/algo/syncer.py), the round's close
(diloco/algo/syncer_merge.py) and publishing (diloco/algo/syncer_publish.py) share.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), sections 3-5.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import optax

from diloco.algo import merge as merging
from diloco.algo import auth, outer_auto, quorum, roundsum
from diloco.algo.claims import Claims
from diloco.algo.codecs import Codec
from diloco.algo.eventlog import Records, Refusals, refuse
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
    # Claims checked against observation (docs/algorithm.md#claims-checked-against-observation): a
    # contribution may claim at most the steps its learner reported since its last merged
    # contribution of the fragment arrived, plus tau (steps taken while it travelled) and this many
    # (bad_counter beyond); None = unchecked (driven without step reports: unit tests, benchmarks).
    claim_slack: int | None = None
    # The most steps the clip allows a contribution's norm for: H + tau + claim_slack, what one send
    # of a learner whose sends are answered spans; a learner whose frames were withheld or refused
    # may truly claim more, but moves Theta no further than that (None = its c_steps).
    clip_span: int | None = None
    # outer.momentum=auto (docs/algorithm.md#outer-statistics-and-automatic-momentum): each fragment's
    # momentum set before each outer step from its measured statistics by this rule; None = `outer`'s own.
    auto: outer_auto.Rule | None = None
    # syncer.outer_stats=on: each merge also measures the consecutive cosine update_cos, keeping the
    # fragment's last merged pseudo-gradient (a float32 copy of it) for it; `auto` turns them on too
    # (measures(): docs/algorithm.md#outer-statistics-and-automatic-momentum says what they cost).
    outer_stats: bool = False
    # fragments.eager=true (docs/algorithm.md#eager-outer-steps): each contribution is a pseudo-gradient
    # against an anchor the learner's stand-in moved at its previous send, so a learner's newer one
    # does not hold its older one's progress, and a repeat in an open round adds the two (REPEAT).
    eager: bool = False


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
    stats: outer_auto.Stats = outer_auto.Stats()  # its merged pseudo-gradients' statistics


class SyncerState(NamedTuple):
    fragments: tuple[FragmentState, ...]
    live: dict[int, int]  # learner -> live incarnation
    last_seq: dict[tuple[int, int], int]
    held: dict[int, tuple[int, ...]]  # learner -> version of each fragment it was last sent
    step_times: quorum.StepTimes = quorum.StepTimes()
    merges: int = 0
    quarantined: dict[str, int] = {}  # refused frames per reason; `refusals` has them per learner too
    decisions: Records = Records()  # every admission and merge as a plain dict, append-only (O(1) each)
    # (learner, incarnation, fragment) -> the base version of its last admitted contribution: a
    # learner applies versions in order, so its later contributions are based on no older one, and
    # older refs that no live learner can still use are freed (`_kept`, docs/design.md#syncer-memory).
    bases: dict[tuple[int, int, int], int] = {}
    # Refusals are counted and only the latest kept: a sender can make any number of them
    # (docs/design.md#damage-in-the-store); run.log_refusals writes every one to metrics.jsonl.
    refusals: Refusals = Refusals()
    claims: Claims = Claims()  # the steps each learner reported, against which c_steps is checked
    # Live learners that finished training, every contribution of theirs delivered: a round stops
    # waiting for them (`expected`; docs/algorithm.md#finished-learners).
    finished: tuple[int, ...] = ()


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


def ref_of(fs: FragmentState, version: int) -> Values | None:
    """The values learners hold at `version` of fs, None once it has left the kept refs."""
    return next((v for ver, v in fs.refs if ver == version), None)


def expected(st: SyncerState, admitted=()) -> tuple[int, ...]:
    """The learners a round waits for: the live ones still training, and of those that finished,
    the ones already in it (`admitted`). A finished learner will send nothing more, so counting it
    would hold K > 1 below quorum forever and leave its slower peers' last contributions unmerged."""
    done = set(st.finished)
    return tuple(sorted(m for m in st.live if m not in done or m in admitted))


def with_fragment(st: SyncerState, p: int, fs: FragmentState) -> SyncerState:
    """st with fragment p's state replaced by fs."""
    return st._replace(fragments=st.fragments[:p] + (fs,) + st.fragments[p + 1:])


def quarantine(st: SyncerState, reason: str, key, now: float, detail: str) -> tuple[SyncerState, tuple]:
    """A refused contribution booked: its reason counted and its record kept among the latest
    (st.refusals), and its Outcome for the ledger."""
    counts = {**st.quarantined, reason: st.quarantined.get(reason, 0) + 1}
    record = {"event": "quarantine", "at": now, "reason": reason, "key": None if key is None else list(key),
              "detail": detail[:200]}
    refusals = refuse(st.refusals, record, reason, None if key is None else int(key[0]))
    outcome = "stale" if reason == "stale" else f"quarantined:{reason}"
    return st._replace(quarantined=counts, refusals=refusals), (Outcome(key, outcome),)


def decision_record(event: str, d: quorum.Decision, c: Contribution | None) -> dict:
    """A quorum decision (and the contribution it was about) as the plain dict the records keep."""
    r = {"event": event, "at": d.at, "fragment": d.fragment, "action": d.action, "reason": d.reason,
         "admitted": list(d.admitted), "missing": list(d.missing), "late": list(d.late),
         "quorum": d.quorum, "t_quorum": d.t_quorum, "grace": d.grace}
    if c is not None:
        r.update(key=list(c.key), base_version=c.base_version, c_steps=c.c_steps, c_tokens=c.c_tokens)
    return r


def merge_rule(cfg: Policy, fs: FragmentState) -> merging.MergeRule:
    """fs's merge rule, read from the registry (merge.MERGES) each time it is needed."""
    return merging.rule(cfg.embedding_merge if fs.spec.embedding else cfg.merge)


def anchor_of(cfg: Policy, fs: FragmentState, base_version: int) -> Values:
    """What a contribution based on `base_version` is taken against (Policy.anchor)."""
    if cfg.anchor == "base":
        ref = ref_of(fs, base_version)
        if ref is not None:
            return ref
    return fs.theta


def measures(cfg: Policy) -> bool:
    """Whether each merge measures the consecutive cosine and keeps the last merged pseudo-gradient
    for it: the config's rule (outer_auto.measured) on the policy, asked for (outer_stats) or needed
    by outer.momentum=auto."""
    return outer_auto.measured("on" if cfg.outer_stats else "auto", cfg.auto is not None)


def theta_norm_of(fs: FragmentState) -> float:
    """||Theta|| of fs, kept with Theta or computed when it is not."""
    return fs.theta_norm if fs.theta_norm is not None else merging.global_norm(fs.theta)


def in_order(tree: Values) -> list[tuple[Path, Any]]:
    """A fragment's {path: array} in sorted path order, the order jax flattens a dict in, so the
    leaves of an optimizer state over the dict line up with those over the tuple of arrays."""
    return sorted(tree.items(), key=lambda kv: kv[0])
