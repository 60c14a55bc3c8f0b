"""A learner unit's send path: from a send the schedule asks for to its contribution frame
(docs/design.md#deferred-encode, docs/design.md#encoding-on-the-device).

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), docs/algorithm.md#learner.

Kept out of diloco/runtime/unit.py, which calls `start` at the step that sends and `frame` when the
frame is wanted (at once, or after the next step is dispatched). These read the unit's params,
anchors, `device_codec` and authentication key, and advance its `codec_states` (error-feedback
residuals), `sent_local` (keep_overlap's send snapshots) and `host_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from diloco.algo import device_codecs
from diloco.algo import learner as lsm
from diloco.algo import messages, payloads
from diloco.algo.codecs import ErrorFeedbackState
from diloco.algo.fragments import Path, get_path
from diloco.algo.merge import pseudo_gradient
from diloco.runtime import unit_eager
from diloco.runtime.transfer import FrameJob, host_copy


class Ticket(NamedTuple):
    """One send on its way to a frame: the packed payload a device encode is copying to the host,
    or (host encode) device copies of the fragment's params, encoded on the host later."""

    send: lsm.Send
    snapshot: dict[Path, jax.Array] | None = None  # host encode
    # device encode: () -> (frame, bytes copied to the host), run at once or on its own thread (job)
    work: Callable[[], tuple[bytes, int]] | None = None
    job: FrameJob | None = None
    anchor: dict[Path, np.ndarray] | None = None  # host encode against this, not the held version (eager)


def start(unit, send: lsm.Send, copy: bool) -> Ticket:
    """Begin send's frame from the fragment's params as this step left them, before the next
    step donates (overwrites) them. With a device encoder the pseudo-gradient and the packed
    payload are computed on the devices now, in step order (so error-feedback residuals
    advance as without deferral), and only the payload is copied to the host, asynchronously.
    Otherwise `copy` queues device copies of the params, to be encoded on the host later.
    An eager send takes its stand-in step now (unit_eager.send) and is framed from the values
    it returns."""
    if unit.spec.schedule.eager:
        local, before = unit_eager.send(unit, send)
        return Ticket(send, snapshot=local, anchor=before)
    if unit.device_codec is None:
        return Ticket(send, snapshot=_snapshot(unit, send) if copy else _live(unit, send.fragment))
    p = send.fragment
    paths = sorted(unit.spec.fragments[p].paths)
    live = tuple(get_path(unit.state.params, path) for path in paths)
    anchor = unit._on_device(p, unit.anchors[p][1])
    residuals = tuple(_residual(unit, path, x) for path, x in zip(paths, live))
    pieces, new = unit.device_codec.encode(tuple(anchor[path] for path in paths), live, residuals)
    for path, r in zip(paths, new):  # error feedback: the residuals stay on the devices
        unit.codec_states[path] = ErrorFeedbackState(r, ())
    for x in jax.tree.leaves(pieces):
        for part in ((x,) if x.is_fully_addressable else (s.data for s in x.addressable_shards)):
            part.copy_to_host_async()
    shapes = [tuple(x.shape) for x in live]
    work = lambda: _device_frame(unit, send, pieces, paths, shapes)  # noqa: E731
    # deferred: framed on a thread of its own while the devices compute
    return Ticket(send, job=FrameJob(work)) if copy else Ticket(send, work=work)


def frame(unit, ticket: Ticket) -> bytes:
    """The frame of a started send: made on its thread, made now from its device payload,
    or its params encoded on the host."""
    if ticket.job is None and ticket.work is None:
        tensors, payload = encode_host(unit, ticket.send, ticket.snapshot, ticket.anchor)
        return _framed(unit, ticket.send, tensors, payload)
    frame_, nbytes = ticket.job.result() if ticket.job is not None else ticket.work()
    unit.host_bytes += nbytes
    return frame_


def encode_host(unit, send: lsm.Send, snapshot: dict[Path, jax.Array],
                anchor: dict[Path, np.ndarray] | None = None) -> tuple[list, bytes]:
    """Quantize anchor - local (a pseudo-gradient against a version the syncer holds) on the
    host; the local values are `snapshot`, the fragment's params right after the sending step.
    `anchor`: the eager anchor the send was made from (default: the held version's values)."""
    frag = unit.spec.fragments[send.fragment]
    anchor = unit.anchors[send.fragment][1] if anchor is None else anchor
    local = jax.device_get(snapshot)  # one transfer for the fragment
    local = {path: np.asarray(local[path], np.float32) for path in frag.paths}
    unit.host_bytes += sum(x.nbytes for x in local.values())
    if unit.spec.schedule.keep:
        unit.sent_local[send.fragment] = local
    diff = pseudo_gradient({path: anchor[path] for path in frag.paths}, local)
    states = {p: unit.codec_states[p] for p in frag.paths if p in unit.codec_states}
    tensors, payload, new_states = payloads.pack_fragment(diff, unit.spec.up_codec, states)
    unit.codec_states.update(new_states)
    return tensors, payload


def _live(unit, p: int) -> dict[Path, jax.Array]:
    """Fragment p's params as the state holds them now (read before the next step runs)."""
    return {path: get_path(unit.state.params, path) for path in unit.spec.fragments[p].paths}


def _residual(unit, path: Path, like: jax.Array):
    if not unit.device_codec.error_feedback:
        return ()
    state = unit.codec_states.get(path)
    return np.zeros(like.shape, np.float32) if state is None else state.residual


def _snapshot(unit, send: lsm.Send) -> dict[Path, jax.Array]:
    """Device copies of the sent fragment's params as this step left them: the next step
    donates (overwrites) the state, and the copy is queued before it, so it reads these."""
    live = _live(unit, send.fragment)
    # A copy, not an alias (no compile, unlike jnp.copy, which compiles per shape).
    return jax.device_put(live, jax.tree.map(lambda x: x.sharding, live), may_alias=False)


def _device_frame(unit, send: lsm.Send, payload, paths, shapes) -> tuple[bytes, int]:
    """(frame, bytes copied to the host) of a device-encoded send. Reads nothing that changes
    after the send started, so it may run on a thread of its own."""
    host = jax.tree.map(host_copy, payload)  # waits for the copies started at the step
    chunks = device_codecs.to_wire(unit.device_codec, host, shapes)
    tensors = [{"path": list(path), "shape": list(shape), "dtype": "float32", "nbytes": len(c)}
               for path, shape, c in zip(paths, shapes, chunks)]
    return _framed(unit, send, tensors, b"".join(chunks)), sum(x.nbytes for x in jax.tree.leaves(host))


def _framed(unit, send: lsm.Send, tensors: list, payload: bytes) -> bytes:
    header = {"kind": "contribution", "learner": unit.learner, "incarnation": unit.ls.incarnation,
              "seq": send.seq, "fragment": send.fragment, "base_version": send.base_version,
              "version": send.base_version, "c_steps": send.c_steps, "c_tokens": send.c_tokens,
              "codec": unit.spec.up_spec, "delta_against": None, "tensors": tensors}
    return messages.encode(header, payload, unit._key)
