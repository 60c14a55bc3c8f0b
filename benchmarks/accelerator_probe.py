"""The accelerator benchmark's probe (benchmarks/accelerator.py): the machine, its devices, and
whether the device encoder writes the host codecs' bytes on them for one real fragment.

The device encoder is byte for byte the host codec on the CPU backend (tests/test_device_codecs.py);
on a GPU, XLA may rewrite a division or contract a multiply-add differently
(docs/design.md#encoding-on-the-device), so the check is repeated on the accelerator.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from common import machine
from diloco.algo import codec_specs, device_codecs
from diloco.algo.fragments import get_path, make_fragments
from diloco.algo.merge import pseudo_gradient
from diloco.config import ModelConfig, from_dict
from diloco.model import build, is_embedding

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# The run's default up codec (configs/codec/int4.yaml), the other block formats, error feedback.
SPECS = ("int4+zstd1", "int8", "fp4", "2bit+ef", "int4+ef+zstd1")
SCALES = (1e-2, 1e-3, 1e-4)  # one round of local progress each: residuals carry across them


def probe(quick: bool) -> dict:
    out = {"machine": machine(),
           "devices": [{"id": d.id, "platform": d.platform, "kind": d.device_kind} for d in jax.devices()]}
    try:
        out["codec_check"] = codec_check(*(("tiny", 256, 4) if quick else ("135m", 49152, 24)))
    except Exception as e:  # recorded: the rest of the benchmark does not depend on it
        out["codec_check"] = {"identical": None, "error": repr(e)}
    return out


def codec_check(preset: str, vocab: int, P: int) -> dict:
    """Every spec over len(SCALES) rounds of one fragment (the largest non-embedding one of
    `preset`, random init), encoded on the default device and by the host codec."""
    cfg = from_dict(ModelConfig, yaml.safe_load((CONFIGS / "model" / f"{preset}.yaml").read_text()))
    params = build(cfg, vocab, seed=0).params
    frag = max((f for f in make_fragments(params, P, "balanced", is_embedding) if not f.embedding),
               key=lambda f: f.size)
    anchor = tuple(jnp.asarray(get_path(params, path), jnp.float32) for path in frag.paths)
    anchor_host = {path: np.asarray(a) for path, a in zip(frag.paths, anchor)}
    shapes = [tuple(a.shape) for a in anchor]
    noise = jax.jit(lambda xs, key, scale: tuple(
        x - scale * jax.random.normal(k, x.shape, jnp.float32) for x, k in zip(xs, jax.random.split(key, len(xs)))))
    specs = {}
    for spec in SPECS:
        dc, codec = device_codecs.for_spec(spec), codec_specs.codec_from_spec(spec)
        residuals = tuple(jnp.zeros(s, jnp.float32) for s in shapes) if dc.error_feedback else ()
        states = {path: codec.init(s) for path, s in zip(frag.paths, shapes)}
        local, row = anchor, {"tensors": 0, "mismatched_tensors": 0, "bytes": 0, "residuals_identical": True}
        for r, scale in enumerate(SCALES):
            local = noise(local, jax.random.key(r), np.float32(scale))
            t = time.perf_counter()
            raw, residuals = dc.encode(anchor, local, residuals)
            got = device_codecs.to_wire(dc, jax.device_get(raw), shapes)
            device_s = time.perf_counter() - t
            t = time.perf_counter()
            diff = pseudo_gradient(anchor_host, {path: np.asarray(x) for path, x in zip(frag.paths, local)})
            want = []
            for path in frag.paths:
                payload, states[path] = codec.encode(diff[path], states[path])
                want.append(payload)
            host_s = time.perf_counter() - t
            row["tensors"] += len(want)
            row["mismatched_tensors"] += sum(g != w for g, w in zip(got, want))
            row["bytes"] += sum(len(w) for w in want)
            if dc.error_feedback:
                row["residuals_identical"] &= all(np.array_equal(np.asarray(x), states[path].residual)
                                                  for x, path in zip(residuals, frag.paths))
        # the last round's: the first compiled the encoder
        row.update(identical=row["mismatched_tensors"] == 0, device_encode_s=device_s, host_encode_s=host_s)
        specs[spec] = row
    return {"preset": preset, "fragment": frag.index, "values": frag.size, "paths": len(frag.paths),
            "device": str(anchor[0].devices()), "specs": specs,
            "identical": all(s["identical"] and s["residuals_identical"] for s in specs.values())}
