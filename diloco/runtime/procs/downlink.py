"""A procs learner's down path: every version published after the one it holds, fetched from the
store in order, past damaged objects (docs/design.md#damage-in-the-store).

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428); docs/design.md#procs.

Kept out of diloco/runtime/procs/learner.py, whose ProcLearner calls `receive` with itself: it
reads the learner's store, setup, `max_frame` and world, and writes its `fetched` (booked with the
next event), `accepted` (the frames a world's followers take at the next step boundary), `bad`,
`skipped` and `ignored`. The order a fragment's objects are tried in is procs/reading.py's.
"""

from __future__ import annotations

import logging

from diloco import store as bs
from diloco.runtime.procs.reading import broadcast_version, candidates
from diloco.runtime.unit import LearnerUnit

log = logging.getLogger(__name__)


def receive(rt, unit: LearnerUnit) -> bool:
    """Fetch every published version newer than the one held, in order; True if any arrived.
    A malformed pointer is logged (once per content) and read again at the next poll."""
    try:
        pointer = bs.latest(rt.store, len(unit.latest), rt.setup.policy.auth)
    except ValueError as e:
        rt.skipped["pointer"] += 1
        rt.ignored.setdefault(bs.LATEST, str(e)[:200])
        if str(e) != rt._bad_pointer:
            rt._bad_pointer = str(e)
            log.warning("learner %d: %s; keeping the versions held", rt.m, e)
        return False
    got = False
    for p, pub in sorted(pointer.items()):
        while unit.latest[p][0] < pub.version and _advance(rt, unit, p, pub):
            got = True
    return got


def _advance(rt, unit: LearnerUnit, p: int, pub: bs.Published) -> bool:
    """Take fragment p past the version held, from the first readable of its candidates
    (diloco/runtime/procs/reading.py: the next version's delta, its full copy, the newest full
    copy, older full copies). An unreadable object is logged, counted and remembered, so it is
    never fetched again (keys are never rewritten once the pointer names them); False if none
    is readable yet."""
    held = unit.latest[p][0]
    for key, codec in candidates(rt.store, p, held, pub, rt.setup.policy.down_spec):
        if key in rt.bad:
            continue
        try:
            frame = bs.get_broadcast(rt.store, key, rt.max_frame, rt.setup.policy.auth)
        except bs.TooLarge as e:
            frame, why = None, str(e)
        except ValueError as e:  # not the syncer's: a learner never applies it
            frame, why = None, str(e)
            rt.ignored.setdefault(key, why[:200])
        else:
            if frame is None:  # collected by gc, or no delta was published
                continue
            rt.fetched.append([rt.clock(), p, len(frame), codec])
            if unit.receive(frame) is not None:
                if rt.world is not None:  # for the followers, at the next step boundary
                    rt.accepted.append(frame)
                new = unit.latest[p][0]  # a bad key of a version now held is never asked for again
                rt.bad = {k for k in rt.bad
                          if not (k.startswith(f"down/{p:04d}/") and broadcast_version(k) <= new)}
                return True
            why = "undecodable (counted in dropped_frames)"
        rt.bad.add(key)
        rt.skipped["delta" if key.endswith(".delta") else "full"] += 1
        log.warning("learner %d: %s is %s; trying the next copy", rt.m, key, why[:200])
    return False
