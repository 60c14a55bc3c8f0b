"""What a procs learner reads from the store besides its own claim: the syncer's current
references it rejoins from (store_view: the newest readable full copy of every fragment; a world's
followers take the very copies their leader read, view_of_frames), and the order it tries a
fragment's broadcast objects in to get past the version it holds (candidates).

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), section 6 (a failed learner
rejoins from the syncer's state); docs/design.md#rejoin and docs/design.md#damage-in-the-store.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any, Callable, Iterator

import numpy as np

from diloco import store as bs
from diloco.algo import messages
from diloco.algo.syncer_publish import unpack_full_copy
from diloco.algo import syncer as sync
from diloco.runtime.build import Setup
from diloco.runtime.procs.child import POLL_MAX, POLL_MIN, max_frame

log = logging.getLogger(__name__)

# Seconds a rejoining learner looks for a readable full copy of a fragment before it gives up on
# it and starts that fragment from Theta_0 at version 0 (its sends are then stale until it catches
# up): the store is damaged beyond what fallbacks mend, and crashing would fail the whole run.
VIEW_TIMEOUT_S = 60.0


def store_view(store: bs.BlobStore, setup: Setup, timeout_s: float = VIEW_TIMEOUT_S,
               skipped: Counter | None = None, sleep: Callable[[float], Any] | None = None,
               clock: Callable[[], float] = time.monotonic, frames: list[bytes] | None = None,
               merges: bool = True) -> tuple[sync.SyncerState, list[tuple[int, int]]]:
    """The syncer's current references as far as a learner can see them: the newest readable full
    copy of every published fragment (Theta_0 for the others), as a SyncerState that new_unit and
    rejoin_unit read (refs[-1] and version only); also (fragment, bytes) of every object fetched.

    The pointer names the newest version; gc may remove it between the pointer read and the get,
    and damage may leave it unreadable. Then the older full copies gc kept are tried, newest
    first, and if none is readable the pointer is read again with back-off (it moves on with the
    next merge), for at most `timeout_s` per fragment; after that the fragment stays at Theta_0,
    logged as an error. Every skip is counted in `skipped` by reason and logged. `frames`, if
    given, collects the full copies the view holds (what the followers of a learner's world take
    it from, view_of_frames). `merges`: sync.init's (a learner never merges).
    """
    skipped = Counter() if skipped is None else skipped
    view = sync.init(setup.policy, setup.fragments, setup.theta0, {}, merges)
    frags, fetched, limit = list(view.fragments), [], max_frame(setup)
    for p, fs in enumerate(frags):
        expected = {path: (x.shape, np.float32) for path, x in fs.theta.items()}
        tried: set[int] = set()  # versions found unreadable: objects are never rewritten

        def attempt() -> tuple[int, dict] | bool | None:
            try:
                pub = bs.latest(store, len(frags), setup.policy.auth).get(p)
            except ValueError as e:
                skipped["pointer"] += 1
                log.warning("rejoin: %s; reading it again", e)
                return None
            if pub is None:
                return True  # never published: Theta_0 is the syncer's reference too
            def versions():  # the one the pointer names, then (listed only if needed) older ones
                yield pub.version
                yield from (v for v in reversed(bs.full_versions(store, p)) if v < pub.version)

            for v in versions():
                if v in tried:
                    continue
                try:
                    frame = bs.fetch_fragment(store, p, v, True, limit, setup.policy.auth)
                except (bs.TooLarge, ValueError) as e:  # too large, or not sealed by the syncer
                    frame, why = None, str(e)
                else:
                    if frame is None:
                        continue  # collected by gc since the pointer or listing was read
                    fetched.append((p, len(frame)))
                    try:
                        values = unpack_full_copy(frame, p, v, expected)
                    except messages.MessageError as e:
                        why = str(e)
                    else:
                        if frames is not None:
                            frames.append(frame)
                        return v, values
                tried.add(v)
                skipped["full"] += 1
                log.warning("rejoin: fragment %d version %d's full copy is unreadable (%s); trying an older one",
                            p, v, why[:200])
            return None

        poller = bs.Poller(POLL_MIN, POLL_MAX, deadline=clock() + timeout_s, sleep=sleep, clock=clock)
        found = poller.until(attempt)
        if found is None:
            skipped["fragment"] += 1
            log.error("rejoin: no readable full copy of fragment %d in %.0f s; it starts from Theta_0 at "
                      "version 0 and catches up with the next version it can read", p, timeout_s)
        if not isinstance(found, tuple):
            continue
        version, values = found
        frags[p] = fs._replace(theta=values, version=version, refs=((version, values),))
    return view._replace(fragments=tuple(frags)), fetched


def view_of_frames(setup: Setup, frames: list[bytes]) -> sync.SyncerState:
    """The view store_view built from these full copies (the ones it collected in `frames`), for a
    follower of a learner's world: it rejoins from the very copies its leader read, never from a
    store whose gc may have moved on since."""
    view = sync.init(setup.policy, setup.fragments, setup.theta0, {}, merges=False)
    frags = list(view.fragments)
    for frame in frames:
        h = messages.decode(frame).header
        p, version = h["fragment"], h["version"]
        values = unpack_full_copy(frame, p, version, {path: (x.shape, np.float32) for path, x in frags[p].theta.items()})
        frags[p] = frags[p]._replace(theta=values, version=version, refs=((version, values),))
    return view._replace(fragments=tuple(frags))


def candidates(store: bs.BlobStore, p: int, held: int, pub: bs.Published, down_spec: str) -> Iterator[tuple[str, str]]:
    """(key, codec) of the objects that may take fragment p past version `held`, in the order a
    learner tries them: the next version's delta (if there may be one; `down_spec` its codec), its
    full copy, the newest full copy, older full copies (listed only if reached)."""
    if held + 1 < pub.version or pub.has_delta:
        yield bs.broadcast_key(p, held + 1, "delta"), down_spec
    yield bs.broadcast_key(p, held + 1, "full"), "fp32"
    if pub.version > held + 1:
        yield bs.broadcast_key(p, pub.version, "full"), "fp32"
        for v in reversed(bs.full_versions(store, p)):
            if held + 1 < v < pub.version:
                yield bs.broadcast_key(p, v, "full"), "fp32"


def broadcast_version(key: str) -> int:
    """The version of a broadcast key, down/<fragment>/<version>.<kind>."""
    return int(key.rsplit("/", 1)[1].split(".", 1)[0])
