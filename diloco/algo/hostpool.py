"""Worker threads for the host passes over large arrays (codecs, a round's sums): a pass is cut into
pieces of a fixed size, so what it computes never depends on how many threads ran it
(docs/experiments.md#syncer-round).

The thread count is the number of cores this process may run on (os.sched_getaffinity, so
`taskset -c 0` gives one), capped by the environment variable DILOCO_HOST_THREADS when it is set.
The numba kernels and zstd release the GIL, so the threads run them in parallel. Each piece is
claimed from a shared counter by whichever thread is free, the caller included: a pass started from
inside another (a tensor's block decode inside a fragment's concurrent decode) never waits on a
piece that no thread will run.

The pool is made on first use and lives as long as the process, as numba's own would; a forked
child makes its own.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

ENV = "DILOCO_HOST_THREADS"
# Values (float32) per piece: 1 MB, a few hundred microseconds of any pass, against a few
# microseconds to claim and dispatch it. Also the unit of every float64 norm's partial sums, so it
# is part of what the norms are: changing it changes their last bits.
CHUNK = 1 << 18

T = TypeVar("T")
_LOCK = threading.Lock()
_POOL: list = [None, 0]  # the executor and its worker count, made on first use
# Unreferenced buffers of one size kept for reuse by aligned_empty (the rest are freed): a round's
# close frees Theta, the optimizer state and the broadcast delta of each tensor and takes as many
# new ones, and a fragment often holds several tensors of one shape.
_IDLE = 12
_BUFFERS_LOCK = threading.Lock()
_BUFFERS: dict[int, list[np.ndarray]] = {}  # aligned_empty's owners by value count, in use or idle
_PROBE = [object()]
_ONLY_LISTED = sys.getrefcount(_PROBE[0])  # what that count reads for an object only a list holds


def threads() -> int:
    """Threads a pass may use: the cores this process may run on, at most DILOCO_HOST_THREADS."""
    n = len(os.sched_getaffinity(0))
    cap = os.environ.get(ENV, "").strip()
    if cap:
        if not cap.isdigit() or int(cap) < 1:
            raise ValueError(f"{ENV} must be a positive integer, got {cap!r}")
        n = min(n, int(cap))
    return n


def pieces(n: int, size: int = CHUNK) -> list[tuple[int, int]]:
    """[lo, hi) ranges of `size` cutting range(n), the last one shorter."""
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


# glibc's malloc settings once a pass runs in pieces: blocks up to 32 MB come from the heap, and up to 64 MB
# freed at the top of each thread's heap stay there. By default glibc hands a freed block of a few
# MB back to the kernel and takes fresh zeroed pages for the next one: a close in pieces allocates
# some MB per piece for XLA's outputs, and those page faults cost a third of its time
# (docs/experiments.md#closing-a-round). Larger blocks (whole tensors) go through aligned_empty.
_MALLOPT = ((-3, 32 << 20), (-1, 64 << 20))  # (M_MMAP_THRESHOLD, bytes), (M_TRIM_THRESHOLD, bytes)


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


@functools.cache  # once per process
def _keep_freed_blocks() -> None:
    libc = _libc()
    if libc is None:  # not glibc (macOS, musl): its allocator's defaults stand
        return
    for option, value in _MALLOPT:
        libc.mallopt(option, value)


# At most one malloc_trim per this many seconds (release_freed): one costs tens of ms on a heap of
# a few GB (60 ms measured at 1.2 GB), and the pages it returns fault in again when next used.
_TRIM_EVERY_S = 5.0
_TRIMMED = [float("-inf")]  # when release_freed last trimmed (time.monotonic)


def release_freed(now: float | None = None, force: bool = False) -> bool:
    """Hand the heap's free pages back to the kernel (glibc's malloc_trim), at most once every
    _TRIM_EVERY_S unless `force`d; True if it trimmed. Called once per learner step: the many
    threads that free and allocate a fragment's arrays (XLA's, this pool's) each grow an arena of
    their own, and without a trim the free space inside them is never returned, so resident memory
    climbs for the whole run (docs/design.md#syncer-memory: +450 MB in 96 steps of a 3.2M model).
    Forced before a run's memory check, for what earlier runs in the process freed, and then it
    also frees the idle buffers of aligned_empty (drop_idle)."""
    now = time.monotonic() if now is None else now
    if not force and now - _TRIMMED[0] < _TRIM_EVERY_S:
        return False
    _TRIMMED[0] = now
    if force:  # between runs: the idle buffers are the last run's (a 135M model's: gigabytes)
        drop_idle()
    libc = _libc()
    if libc is None:  # not glibc: nothing to ask
        return False
    libc.malloc_trim(0)
    return True


def drop_idle() -> int:
    """Free aligned_empty's buffers that nothing references; returns their bytes. The pool keeps up
    to _IDLE of each size for the next round of a run, which a later run in the same process (a
    study's next variant) does not reuse when its fragments differ, and which its memory check
    would otherwise count as taken."""
    with _BUFFERS_LOCK:
        freed = 0
        for n, owners in list(_BUFFERS.items()):
            idle = set(_idle(owners))
            freed += sum(owners[i].nbytes for i in idle)
            keep = [raw for i, raw in enumerate(owners) if i not in idle]
            if keep:
                _BUFFERS[n] = keep
            else:
                del _BUFFERS[n]
        return freed


def _executor(workers: int) -> ThreadPoolExecutor:
    with _LOCK:
        if _POOL[0] is None or _POOL[1] < workers:
            old = _POOL[0]
            _POOL[:] = [ThreadPoolExecutor(workers, thread_name_prefix="diloco-host"), workers]
            if old is not None:
                old.shutdown(wait=False)
        return _POOL[0]


def _forget() -> None:
    """In a forked child: it inherits the executor but none of its threads, and maybe a lock
    another thread held at the fork."""
    global _LOCK, _BUFFERS_LOCK
    _LOCK, _BUFFERS_LOCK = threading.Lock(), threading.Lock()
    _POOL[:] = [None, 0]


os.register_at_fork(after_in_child=_forget)


def run(tasks: Sequence[Callable[[], T]], parallel: bool = True) -> list[T]:
    """Each task's result, in order, the tasks run on up to threads() threads (one, the caller's,
    unless `parallel`: small work is not worth a hand-off); the first task's exception (in task
    order) is raised after all have ended."""
    n = len(tasks)
    if n > 1:
        _keep_freed_blocks()
    helpers = min(threads(), n) - 1 if parallel else 0
    if helpers <= 0:
        return [t() for t in tasks]
    results: list = [None] * n
    errors: dict[int, BaseException] = {}
    claim = itertools.count()  # next() on it is atomic under the GIL
    finished = [0]
    done = threading.Condition()

    def work() -> None:
        while (i := next(claim)) < n:
            try:
                results[i] = tasks[i]()
            except BaseException as e:  # noqa: BLE001 (re-raised by the caller, in task order)
                errors[i] = e
            with done:
                finished[0] += 1
                if finished[0] == n:
                    done.notify_all()

    pool = _executor(helpers)
    for _ in range(helpers):
        pool.submit(work)
    work()
    with done:
        done.wait_for(lambda: finished[0] == n)
    if errors:
        raise errors[min(errors)]
    return results


def start(task: Callable[[], T], parallel: bool = True) -> Callable[[], T]:
    """task() begun on a pool thread (run now where this process may use one core, or unless
    `parallel`); the function returned waits for its result (raises its exception), and may be
    called again."""
    if not parallel or threads() < 2:
        value = task()
        return lambda: value
    return _executor(threads() - 1).submit(task).result


def each(n: int, body: Callable[[int, int], T], size: int = CHUNK) -> list[T]:
    """body(lo, hi) over pieces(n, size), in parallel when there is more than one piece."""
    return run([lambda lo=lo, hi=hi: body(lo, hi) for lo, hi in pieces(n, size)])


def aligned_empty(n: int) -> np.ndarray:
    """np.empty(n, float32) at a 64-byte boundary: jax then reads it in place instead of copying
    it (the round's close takes the sums and refs this way; a 155 MB copy each otherwise).

    An array of CHUNK values or more reuses the memory of an earlier one of the same size that
    nothing references any more (CPython's reference count of its owner, which every view, numba
    call and jax buffer reading it holds); the next request of a size frees all but _IDLE of its
    unreferenced ones. A fresh one costs a page fault per page on first write, and with
    transparent huge pages a compaction when memory is fragmented: 15-20 ms for 155 MB on a quiet
    machine, 300 ms measured under memory pressure, once per contribution, against the 8 ms of
    writing it again."""
    if n < CHUNK:
        return _aligned(np.empty(4 * n + 64, np.uint8), n)
    with _BUFFERS_LOCK:
        owners = _BUFFERS.setdefault(n, [])
        idle = _idle(owners)
        for i in reversed(idle[_IDLE:]):
            del owners[i]
        if idle:
            raw = owners[idle[0]]
        else:
            raw = np.empty(4 * n + 64, np.uint8)
            owners.append(raw)
    return _aligned(raw, n)


def _idle(owners: list[np.ndarray]) -> list[int]:
    """Indices of the owners nothing but the list references (no view, numba call or jax buffer)."""
    return [i for i in range(len(owners)) if sys.getrefcount(owners[i]) == _ONLY_LISTED]


def _aligned(raw: np.ndarray, n: int) -> np.ndarray:
    off = (-raw.ctypes.data) % 64
    return raw[off:off + 4 * n].view(np.float32)
