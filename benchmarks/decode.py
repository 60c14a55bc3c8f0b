"""Decode speed of `generate` (the loop on the device) against a host loop of one dispatch a token.

    python benchmarks/decode.py                                  # small and base10m, batch 1 and 8
    python benchmarks/decode.py --models 135m --vocab 49152 --new-tokens 256    # on an accelerator

Writes benchmarks/results/decode.json: per model and batch, the decode tokens/s of each (the tokens
after the first over the time after the prefill, greedy, no stop token), their ratio per repeat
(old and new interleaved, so load on the machine hits both alike), and whether the tokens agree.
`generate` is one dispatch, so its prefill is timed by a call for one new token and taken off.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from diloco.config import ModelConfig, from_dict  # noqa: E402
from diloco.model import build, count_params  # noqa: E402
from diloco.model.generate import Sampling, generate, init_cache, left_pad, sample  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


class Timed(NamedTuple):
    tokens: list[list[int]]
    compile_s: float
    prefill_s: float
    decode_s: float  # the tokens after the first
    decode_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s


def on_device(model, cfg: ModelConfig, prompts, max_new_tokens: int, sampling: Sampling) -> Timed:
    """`generate`, with its prefill (a one-token call of the same prompts) taken off its run time."""
    one = generate(model, cfg, prompts, 1, sampling)
    out = generate(model, cfg, prompts, max_new_tokens, sampling)
    return Timed(out.tokens, out.compile_s, one.run_s, out.run_s - one.run_s, out.new_tokens - len(prompts))


def per_token(model, cfg: ModelConfig, prompts, max_new_tokens: int, sampling: Sampling) -> Timed:
    """The baseline: generate as it was before its loop moved onto the device, a jitted prefill and
    then a host loop calling a jitted one-token step (compiled anew every call, as it was)."""
    params = model.params
    tokens_BxP, mask_BxP = left_pad(prompts)
    B = len(prompts)
    cache = init_cache(cfg, B, tokens_BxP.shape[1] + max_new_tokens)

    def prefill(params, tokens_BxP, mask_BxP, cache, key):
        logits_BxPxV, cache = model.decode(params, tokens_BxP, mask_BxP, cache)
        return sample(logits_BxPxV[:, -1], key, sampling), cache

    def step(params, tokens_B, cache, key):
        logits_Bx1xV, cache = model.decode(params, tokens_B[:, None], jnp.ones((B, 1), bool), cache)
        return sample(logits_Bx1xV[:, 0], key, sampling), cache

    keys = jax.random.split(jax.random.key(0), max_new_tokens)
    t0 = time.perf_counter()
    prefill_c = jax.jit(prefill).lower(params, tokens_BxP, mask_BxP, cache, keys[0]).compile()
    step_c = jax.jit(step, donate_argnums=2).lower(params, jnp.zeros((B,), jnp.int32), cache, keys[0]).compile()
    t1 = time.perf_counter()
    next_B, cache = prefill_c(params, tokens_BxP, mask_BxP, cache, keys[0])
    out = [np.asarray(next_B)]
    t2 = time.perf_counter()
    for i in range(1, max_new_tokens):
        next_B, cache = step_c(params, next_B, cache, keys[i])
        out.append(np.asarray(next_B))
    t3 = time.perf_counter()
    return Timed(np.stack(out, axis=1).tolist(), t1 - t0, t2 - t1, t3 - t2, B * (max_new_tokens - 1))


def bench(name: str, vocab: int, batch: int, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    cfg = from_dict(ModelConfig, yaml.safe_load((CONFIGS / "model" / f"{name}.yaml").read_text()))
    model = build(cfg, vocab, seed=0)
    rng = np.random.default_rng(0)
    # Unequal prompt lengths (left-padded), as a batch of real prompts would be.
    prompts = [rng.integers(0, vocab, prompt_len - (row % 4)).tolist() for row in range(batch)]
    sampling = Sampling()
    first_new = on_device(model, cfg, prompts, new_tokens, sampling)  # compiles; later calls reuse it
    old, new = [], []
    for _ in range(repeats):
        old.append(per_token(model, cfg, prompts, new_tokens, sampling))
        new.append(on_device(model, cfg, prompts, new_tokens, sampling))
    rate = lambda runs: statistics.median(r.tokens_per_s for r in runs)  # noqa: E731
    ratios = [n.tokens_per_s / o.tokens_per_s for o, n in zip(old, new)]
    return {"model": name, "params": count_params(model.params), "dtype": cfg.dtype, "batch": batch,
            "prompt_len": prompt_len, "new_tokens": new_tokens,
            "old_tokens_per_s": round(rate(old), 1), "new_tokens_per_s": round(rate(new), 1),
            "ratio_median": round(statistics.median(ratios), 2), "ratios": [round(r, 2) for r in ratios],
            "old_ms_per_step": round(1e3 * statistics.median(r.decode_s for r in old) / (new_tokens - 1), 3),
            "new_ms_per_step": round(1e3 * statistics.median(r.decode_s for r in new) / (new_tokens - 1), 3),
            "old_compile_s_per_call": round(statistics.median(r.compile_s for r in old), 2),
            "new_compile_s_first_call": round(first_new.compile_s, 2),
            "new_compile_s_later_calls": round(statistics.median(r.compile_s for r in new), 4),
            "same_tokens": all(o.tokens == n.tokens for o, n in zip(old, new))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["small", "base10m"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = [bench(m, args.vocab, b, args.prompt_len, args.new_tokens, args.repeats)
            for m in args.models for b in args.batches]
    path = write("decode", {"args": vars(args), "results": rows}, args.out)
    print(f"{'model':<9}{'batch':>6}{'old tok/s':>11}{'new tok/s':>11}{'ratio':>7}{'old ms':>8}{'new ms':>8}  same")
    for r in rows:
        print(f"{r['model']:<9}{r['batch']:>6}{r['old_tokens_per_s']:>11,.0f}{r['new_tokens_per_s']:>11,.0f}"
              f"{r['ratio_median']:>7.2f}{r['old_ms_per_step']:>8.3f}{r['new_ms_per_step']:>8.3f}  {r['same_tokens']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
