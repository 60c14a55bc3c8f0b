"""Publishing a merged fragment (docs/algorithm.md#broadcasts): the quantized delta for learners
that hold the previous version, a full FP32 copy for the others, the new reference learners will
reconstruct, and which older references a contribution may still be based on.
"""

from __future__ import annotations

import numpy as np

from diloco.algo import codec_specs, hostpool, messages, payloads, roundsum
from diloco.algo.syncer_state import FragmentState, Policy, Publish, SyncerState, Values, expected, with_fragment


def publish(cfg: Policy, st: SyncerState, fs: FragmentState, p: int,
             merged: tuple[tuple[int, int, int], ...], diff: Values) -> tuple[SyncerState, Publish]:
    """New ref = old ref + decode(encode(Theta - old ref)) (`diff` = Theta - old ref); learners
    holding the previous version get that delta, others (joiners, learners that missed a version)
    a full FP32 copy, built only if one of them needs it."""
    prev_version, prev = fs.refs[-1]
    if cfg.down_codec is None:
        ref, delta_frame = fs.theta, None
    else:
        tensors, payload, _ = payloads.pack_fragment(diff, cfg.down_codec)
        # the frame (its checksum) is built on a pool thread while the new ref is decoded and summed
        framed = hostpool.start(lambda: frame(p, fs.version, prev_version, cfg.down_spec, tensors, payload,
                                               merged), len(payload) >= hostpool.CHUNK)
        decoded = payloads.unpack_fragment({"codec": cfg.down_spec, "tensors": tensors}, payload,
                                           cfg.down_codec, {k: (v.shape, np.float32) for k, v in prev.items()})
        ref = {path: roundsum.add_into(prev[path], decoded[path]) for path in prev}
        delta_frame = framed()
    full_copy = None
    frames, full = {}, []
    held = dict(st.held)
    for m in expected(st):  # the learners still training: a finished one reads no more broadcasts
        versions = held.get(m, (-1,) * len(st.fragments))
        if delta_frame is not None and versions[p] == prev_version:
            frames[m] = delta_frame
        else:
            if full_copy is None:
                tensors, payload, _ = payloads.pack_fragment(ref, codec_specs.codec_from_spec("fp32"))
                full_copy = frame(p, fs.version, None, "fp32", tensors, payload, merged)
            frames[m] = full_copy
            full.append(m)
        held[m] = versions[:p] + (fs.version,) + versions[p + 1:]
    refs = _kept(st, fs, p, (fs.refs + ((fs.version, ref),))[-cfg.history:])
    st = with_fragment(st, p, fs._replace(refs=refs))
    return st._replace(held=held), Publish(p, fs.version, frames, tuple(full), merged)


def _kept(st: SyncerState, fs: FragmentState, p: int, refs: tuple) -> tuple:
    """Of fragment p's `refs` (newest last, always kept), those a contribution may still be based
    on: none older than the oldest base of the open round's contributions or of the last one of any
    learner still training. One with no admitted contribution yet (a joiner) keeps them all, up to
    Policy.history (docs/design.md#syncer-memory)."""
    floor = min((c.base_version for c in fs.contributions), default=refs[-1][0])
    for m in expected(st):  # a finished learner sends nothing more: its round's contributions count above
        base = st.bases.get((m, st.live[m], p))
        if base is None:
            return refs
        floor = min(floor, base)
    return tuple(r for r in refs[:-1] if r[0] >= floor) + refs[-1:]


def frame(p: int, version: int, delta_against: int | None, spec: str, tensors, payload: bytes,
           merged: tuple[tuple[int, int, int], ...] = ()) -> bytes:
    header = {"kind": "fragment", "learner": 0, "incarnation": 0, "seq": version, "fragment": p,
              "base_version": delta_against if delta_against is not None else version,
              "version": version, "c_steps": 0, "c_tokens": 0, "codec": spec,
              "delta_against": delta_against, "tensors": tensors, "merged": [list(k) for k in merged]}
    return messages.encode(header, payload)


def unpack_full_copy(raw: bytes, p: int, version: int, expected: dict) -> dict:
    """The values of fragment p's full copy of `version` (what `frame` encodes with delta_against
    None); MessageError if `raw` is not that."""
    msg = messages.decode(raw)
    h = msg.header
    if (h["kind"], h["fragment"], h["version"], h["delta_against"]) != ("fragment", p, version, None):
        raise messages.MessageError("bad_header", f"not the full copy of fragment {p} version {version}: "
                                    f"{h['kind']} {h['fragment']} {h['version']} {h['delta_against']}")
    return payloads.unpack_fragment(h, msg.payload, None, expected)
