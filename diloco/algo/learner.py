"""The learner state machine: per-fragment counters, the send schedule, applying merged fragments tau
steps after sending, and the stall rule (docs/algorithm.md#learner).

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428); fragments and overlap from
Streaming DiLoCo (arXiv 2501.18512).

The state is bookkeeping only (ints and tuples). Parameters live on the learner's devices and the
fragment values in the runtime's learner unit; the events here say what to do with them: which
fragment to encode and send after a step, and which received global fragment to apply before one.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from diloco.algo.fragments import Schedule, due


class Send(NamedTuple):
    """Action: encode fragment `fragment` against the held version `base_version` and send it."""

    fragment: int
    seq: int
    base_version: int
    c_steps: int
    c_tokens: int
    step: int  # local step after which it was sent


class InFlight(NamedTuple):
    fragment: int
    seq: int
    sent_at: int  # local step after which it left
    c_steps: int = 0  # the fragment's counters when it left (what a kept overlap subtracts);
    c_tokens: int = 0  # -1 once an overwrite of the fragment voided them


class Pending(NamedTuple):
    """A merged global fragment that arrived and waits for its apply step."""

    fragment: int
    version: int
    apply_at: int  # applied before the local step apply_at + 1, i.e. once step >= apply_at
    answers: tuple[int, ...] = ()  # seqs of this learner's sends the merge took in
    kept: bool = False  # set by to_apply: local progress survives the apply (Schedule.keep)


DEFERRED = 2**62  # apply_at of a merge held until an answer (Schedule.others == "defer") or a give-up


class LearnerState(NamedTuple):
    learner: int
    incarnation: int  # grows on every restart; the syncer drops messages of dead incarnations
    step: int  # local inner steps taken by this incarnation's parameters
    seq: int  # sequence number of the last message sent
    c_steps: tuple[int, ...]  # per fragment: inner steps since fragment p was last applied
    c_tokens: tuple[int, ...]  # per fragment: tokens over those steps
    versions: tuple[int, ...]  # per fragment: the global version the learner holds (its anchor)
    in_flight: tuple[InFlight, ...] = ()
    pending: tuple[Pending, ...] = ()


def init(learner: int, incarnation: int, versions: tuple[int, ...], step: int = 0) -> LearnerState:
    """A learner holding global `versions`, with zero counters (a fresh start or a rejoin)."""
    zeros = (0,) * len(versions)
    return LearnerState(learner, incarnation, step, 0, zeros, zeros, tuple(versions))


def after_step(st: LearnerState, schedule: Schedule, tokens: int) -> tuple[LearnerState, tuple[Send, ...]]:
    """Count one inner step of `tokens` tokens; return the sends the schedule asks for now."""
    step = st.step + 1
    c_steps = tuple(c + 1 for c in st.c_steps)
    c_tokens = tuple(c + tokens for c in st.c_tokens)
    sends, in_flight, seq = [], list(st.in_flight), st.seq
    for p in due(schedule, step):
        seq += 1
        sends.append(Send(p, seq, st.versions[p], c_steps[p], c_tokens[p], step))
        in_flight.append(InFlight(p, seq, step, c_steps[p], c_tokens[p]))
    if schedule.eager:  # the stand-in step moved the learner to its new anchor: the next send counts from here
        gone = {send.fragment for send in sends}
        c_steps = tuple(0 if p in gone else c for p, c in enumerate(c_steps))
        c_tokens = tuple(0 if p in gone else c for p, c in enumerate(c_tokens))
    st = st._replace(step=step, seq=seq, c_steps=c_steps, c_tokens=c_tokens, in_flight=tuple(in_flight))
    return st, tuple(sends)


def flush(st: LearnerState, eager: bool = False) -> tuple[LearnerState, tuple[Send, ...]]:
    """The end of training: send every fragment with progress not yet sent or in flight.

    Without it the global model would miss up to H steps of each learner's last progress
    (DiLoCo ends with a final outer step over everything the workers did). With eager outer steps
    a fragment in flight is sent too: its counters hold only the progress since that send.
    """
    sending = set() if eager else {f.fragment for f in st.in_flight}
    sends, in_flight, seq = [], list(st.in_flight), st.seq
    for p, steps in enumerate(st.c_steps):
        if steps > 0 and p not in sending:
            seq += 1
            sends.append(Send(p, seq, st.versions[p], steps, st.c_tokens[p], st.step))
            in_flight.append(InFlight(p, seq, st.step, steps, st.c_tokens[p]))
    return st._replace(seq=seq, in_flight=tuple(in_flight)), tuple(sends)


def on_fragment(st: LearnerState, schedule: Schedule, fragment: int, version: int,
                merged: frozenset[tuple[int, int, int]] = frozenset()) -> LearnerState:
    """A merged global fragment arrived: schedule its application.

    `merged` lists the (learner, incarnation, seq) the merge took in. If it took in this learner's
    send, the merge answers it and is applied tau steps after that send (the overlap of Streaming
    DiLoCo section 2.3). Otherwise (a merge another learner triggered, while this learner's own
    contribution waits for the next round) it is applied before the next step, or with
    `schedule.others == "defer"` held until an answer or a give-up; the send stays in flight.
    Versions not newer than one already held or pending are ignored; a newer one replaces a pending
    one and inherits what it answered (versions are cumulative).
    """
    newest = max([st.versions[fragment]] + [q.version for q in st.pending if q.fragment == fragment])
    if version <= newest:
        return st
    own = {seq for learner, inc, seq in merged if learner == st.learner and inc == st.incarnation}
    sent = {f.seq: f.sent_at for f in st.in_flight if f.fragment == fragment}
    answers = tuple(sorted({seq for seq in own if seq in sent}.union(
        *[q.answers for q in st.pending if q.fragment == fragment])))
    if answers:
        apply_at = max(st.step, min(sent.get(seq, st.step - schedule.tau) for seq in answers) + schedule.tau)
    else:
        apply_at = DEFERRED if schedule.others == "defer" else st.step
    pending = tuple(q for q in st.pending if q.fragment != fragment)
    return st._replace(pending=pending + (Pending(fragment, version, apply_at, answers),))


def to_apply(st: LearnerState, schedule: Schedule) -> tuple[LearnerState, tuple[Pending, ...]]:
    """Pop the pending fragments due before the next step. The sends they answer (with any earlier
    send of the same fragment) leave flight. Counters reset, except where the apply keeps local
    progress (schedule.keep; returned with kept=True): a merge answering a send keeps the progress
    made since that send, and the counters drop to it; another learner's merge keeps all of it
    (the runtime rebases it onto the new version) and the counters stay.
    An overwrite also voids the counters of the fragment's sends still in flight, so a later answer
    to one of them overwrites too (the snapshot it would keep from is gone)."""
    ready = tuple(q for q in st.pending if q.apply_at <= st.step)
    if not ready:
        return st, ()
    answered = {q.fragment: max(q.answers) for q in ready if q.answers}
    sent = {(f.fragment, f.seq): f for f in st.in_flight}
    c_steps, c_tokens, versions, out = list(st.c_steps), list(st.c_tokens), list(st.versions), []
    for q in ready:
        p, f = q.fragment, sent.get((q.fragment, answered.get(q.fragment)))
        if schedule.eager:  # the counters already count from the last send (after_step)
            versions[p] = q.version
            out.append(q._replace(kept=True))
            continue
        if not q.answers:  # another learner's merge: kept = the unsent progress is rebased onto it
            kept = schedule.keep
        else:
            kept = schedule.keep and f is not None and f.c_steps >= 0
            if kept:
                c_steps[p], c_tokens[p] = c_steps[p] - f.c_steps, c_tokens[p] - f.c_tokens
        if not kept:
            c_steps[p], c_tokens[p] = 0, 0
        versions[p] = q.version
        out.append(q._replace(kept=kept))
    overwritten = {q.fragment for q in out if not q.kept}
    in_flight = tuple(f._replace(c_steps=-1, c_tokens=-1) if f.fragment in overwritten else f
                      for f in st.in_flight if f.seq > answered.get(f.fragment, -1))
    st = st._replace(c_steps=tuple(c_steps), c_tokens=tuple(c_tokens), versions=tuple(versions),
                     pending=tuple(q for q in st.pending if q.apply_at > st.step), in_flight=in_flight)
    return st, tuple(out)


def blocking(st: LearnerState, schedule: Schedule) -> InFlight | None:
    """The send whose merged fragment is overdue (sent at least tau steps ago), if any.

    The learner must not take another step until it arrives (tau-bounded staleness), or until
    the runtime's stall limit makes it `give_up`.
    """
    overdue = [f for f in st.in_flight
               if st.step >= f.sent_at + schedule.tau
               and not any(q.fragment == f.fragment and q.answers and max(q.answers) >= f.seq
                           for q in st.pending)]
    return min(overdue, key=lambda f: f.sent_at) if overdue else None


def give_up(st: LearnerState, fragment: int) -> LearnerState:
    """Stop waiting for `fragment` after the stall limit; it is applied whenever it arrives, and a
    deferred newer version of it is applied before the next step."""
    pending = tuple(q._replace(apply_at=st.step) if q.fragment == fragment and q.apply_at == DEFERRED else q
                    for q in st.pending)
    return st._replace(in_flight=tuple(f for f in st.in_flight if f.fragment != fragment), pending=pending)


# --- the numeric rules a learner unit applies to its arrays (diloco/runtime/unit.py moves them) ---

def applied(glob: np.ndarray, local: np.ndarray | None, sent: np.ndarray | None, alpha: float) -> np.ndarray:
    """A tensor of a fragment when the merged version `glob` is applied (docs/algorithm.md#applying-merged-fragments).

    With the snapshot `sent` of the answered send (fragments.keep_overlap): Theta plus the progress
    made since that send. Otherwise the mix alpha * local + (1 - alpha) * Theta; alpha = 0, the
    default, overwrites (and needs no local copy).
    """
    if sent is not None:
        return glob + (local - sent)
    if alpha == 0.0:
        return glob
    return alpha * local + (1 - alpha) * glob


def rebased(x: np.ndarray, before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """Move a tensor (local params, or a send's snapshot) by the new version's change, after - before:
    the unsent progress rides on the new version."""
    return x + (after - before)
