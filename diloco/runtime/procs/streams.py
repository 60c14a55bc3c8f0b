"""The procs syncer's walk along the learners' event streams: each live incarnation's events
journalled in number order, a gap skipped once it is old enough (or at once after the learner
exited), and an exit notice booked as a death, or as done for an exit 0 whose Done was lost.

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428); docs/design.md#damage-in-the-store.

Kept out of diloco/runtime/procs/syncer.py, whose ProcSyncer calls `poll` (and at a stop `drain`)
with itself: these read its store, cursors and `host.done`, journal each step through its `_do`,
and keep its `heard`, `gaps` and `skipped`. The single objects are read and checked in
procs/intake.py.
"""

from __future__ import annotations

import logging
import time

from diloco.runtime.procs.intake import authentic_event, listed_events, read_notice

log = logging.getLogger(__name__)

# A learner writes its events one after another, each whole before the next, so event n missing
# while a later one is listed is damage (or a store slow to show it): after this long it is
# skipped, with an error, and the stream booked on from the next event there.
GAP_TIMEOUT_S = 5.0
GAP_CHECK_S = 1.0  # seconds of silence on a stream before its keys are listed to look for a gap


def poll(rt, m: int) -> bool:
    """Book what learner m's live incarnation has written since, then its exit notice if there is
    one; True if anything was booked."""
    inc = rt.current[m]
    got = drain(rt, m, inc)
    notice = read_notice(rt.store, m, inc, rt.secret, rt.ignored)
    if notice is not None:
        drain(rt, m, inc, exited=True)  # it exited before the notice: every event of it is there
        if notice["exitcode"] != 0:
            rt._do({"do": "bury", "m": m, "inc": inc, "at": notice["at"]})
            return True
        if m not in rt.host.done:
            log.error("learner %d incarnation %d exited 0 without a readable Done event (its last "
                      "event); booking it done at its exit", m, inc)
            rt._do({"do": "done", "m": m, "inc": inc, "at": notice["at"]})
            got = True
    return got


def drain(rt, m: int, inc: int, exited: bool = False) -> bool:
    """Journal every event of (m, inc) from its cursor on, and every gap due to be skipped."""
    got = False
    while True:
        raw = authentic_event(rt.store, rt.secret, m, inc, rt.cursor[m], rt.ignored)
        if raw is not None:
            rt._do({"do": "event", "m": m, "inc": inc, "n": rt.cursor[m]}, raw)
            rt.heard[m] = time.monotonic()
            got = True
            continue
        to = _gap(rt, m, inc, exited)
        if to is None:
            return got
        rt._do({"do": "skip", "m": m, "inc": inc, "n": rt.cursor[m], "to": to})
        got = True


def _gap(rt, m: int, inc: int, exited: bool) -> int | None:
    """The next event listed after a missing one, once the gap is `rt.gap_timeout` old (at once if
    the process has exited: it wrote all it ever will); else None. Lists at most every
    GAP_CHECK_S of silence, and not for a learner that is done (Done is its last event)."""
    now = time.monotonic()
    if m in rt.host.done or (not exited and now - rt.heard[m] < GAP_CHECK_S):
        return None
    rt.heard[m] = now
    n = rt.cursor[m]
    # Only an event of the learner's own proves n was skipped: keys a forger wrote ahead of the
    # stream prove nothing, and the real events will land on them.
    later = next(([k] for k in listed_events(rt.store, m, inc) if k > n
                  and authentic_event(rt.store, rt.secret, m, inc, k, rt.ignored) is not None), [])
    if not later:
        return None
    since = rt.gaps.setdefault((m, inc, n), now)
    if not exited and now - since < rt.gap_timeout:
        return None
    del rt.gaps[(m, inc, n)]
    rt.skipped += 1
    log.error("learner %d incarnation %d: events %d to %d are missing from the store (for %.1f s); "
              "skipping them, what they booked is lost", m, inc, n, min(later) - 1, now - since)
    return min(later)
