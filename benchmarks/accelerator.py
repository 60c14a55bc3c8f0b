"""The accelerator benchmark: learner against plain trainer, syncer rounds, sim against data parallel.

    python benchmarks/accelerator.py              # one GPU, at most 9.5 minutes (scripts/accelerator_run.sh)
    python benchmarks/accelerator.py --quick      # tiny shapes, a few minutes on a CPU

Each part runs as a subprocess under its own timeout (the parts after it keep a reserve of the
`--budget`), and a part that fails or runs out is recorded, not fatal. The one JSON
(benchmarks/results/accelerator.json, or --out) is rewritten after every part, so a run cut short
loses only the part it was in:

* probe: the machine, `jax.devices()`, and whether the device encoder's payload (and error-feedback
  residual) is byte for byte the host codec's for one real fragment of the `135m` model
  (docs/design.md#encoding-on-the-device: XLA on a GPU may divide or fuse differently from the CPU);
* learner_<model>_<encode>: benchmarks/learner_overhead.py at the `1b` preset (bf16, 8 x 1024) and
  at SmolLM2-135M's shape (`135m`, bf16, 16 x 1024), P = H = 24, tau 2, one device, with the
  encode on the device and on the host;
* syncer: benchmarks/syncer_round.py at 4.64M and 38.8M values, M = 4 and 16;
* sim_vs_dp: benchmarks/train_vs_dp.py, base10m, 4 learners of batch 8 against batch 32;
* inner_step: benchmarks/inner_step.py, the plain step's tokens/s, MFU and peak memory at
  SmolLM2-135M's shape (16 x 1024, remat none and dots) and Llama-3.2-1B's (8 x 1024, dots),
  bf16, chunked loss;
* decode: benchmarks/decode.py, batch-1 and batch-8 decode of the 135M shape, 256 new tokens.

The goals (docs/experiments.md#accelerator-benchmark) are checked at the end of the JSON. Compiled
executables are shared between the parts through JAX's persistent cache, so a model's second
learner run reads its step from the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from common import RESULTS  # noqa: E402


class Part(NamedTuple):
    name: str
    argv: list[str]
    timeout_s: float
    reserve_s: float  # kept for this part out of the budget while the parts before it run


def parts(args) -> list[Part]:
    py, q = sys.executable, args.quick
    out = []
    out.append(Part("probe", [py, str(HERE / "accelerator.py"), "--probe"] + (["--quick"] if q else []), 90, 20))
    # (preset, vocabulary, batch, seq): the 1b preset's BPE vocabulary, SmolLM2's tokenizer
    shapes = [("tiny", 256, 4, 64)] if q else [("1b", 32768, 8, 1024), ("135m", 49152, 16, 1024)]
    P = 4 if q else 24
    for model, vocab, batch, seq in shapes:
        for encode in ("device", "host"):
            argv = [py, str(HERE / "learner_overhead.py"), "--model", model, "--vocab", str(vocab),
                    "--batch", str(batch), "--seq", str(seq), "--devices", "1", "-P", str(P), "-H", str(P),
                    "--tau", "2", "--steps", str(args.steps), "--repeats", str(args.repeats), "--encode", encode]
            if not q:
                argv += ["--dtype", "bfloat16"]
            out.append(Part(f"learner_{model}_{encode}", argv, 60 if q else 150, 40))
    sizes, learners = (["1e5", "4e5"], ["2", "4"]) if q else (["4.64e6", "3.88e7"], ["4", "16"])
    out.append(Part("syncer", [py, str(HERE / "syncer_round.py"), "--sizes", *sizes, "--learners", *learners,
                               "--repeats", "1" if q else "3", "--max-values", "700000000"], 100, 40))
    model, steps = ("tiny", 20) if q else ("base10m", 100)
    out.append(Part("sim_vs_dp", [py, str(HERE / "train_vs_dp.py"), "--steps", str(steps), "--rounds", "1",
                                  "--set", f"model={model}", "data=synthetic", "data.synthetic_vocab=256",
                                  "runtime.devices_per_learner=1", "inner.warmup_steps=10", "run.eval_every=50"],
                    120, 60))
    if q:
        grid = [("tiny", "256", "4", "64", ["none", "full"])]
    else:
        grid = [("135m", "49152", "16", "1024", ["none", "dots"]), ("llama3_1b", "128256", "8", "1024", ["dots"])]
    for model, vocab, batch, seq, remat in grid:
        out.append(Part(f"inner_step_{model}", [py, str(HERE / "inner_step.py"), "--models", model, "--vocab", vocab,
                                                "--batch", batch, "--seq", seq, "--devices", "1",
                                                "--steps", "5" if q else "10",
                                                "--repeats", "2", "--remat", *remat,
                                                "--loss-chunk", "0" if q else "256"], 90 if q else 100, 30))
    out.append(Part("decode", [py, str(HERE / "decode.py"), "--models", "tiny" if q else "135m", "--vocab",
                               "256" if q else "49152", "--new-tokens", "32" if q else "256", "--repeats", "2"],
                    60 if q else 90, 30))
    return out


def run_part(part: Part, timeout_s: float, scratch: Path) -> dict:
    """The part's JSON (its --out) with its exit status and wall time; its process group is
    killed at the timeout (train_vs_dp's runs are grandchildren)."""
    out = scratch / f"{part.name}.json"
    argv = part.argv + ["--out", str(out)]
    row = {"cmd": " ".join(argv[1:]), "timeout_s": round(timeout_s, 1)}
    t = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True, text=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
    row.update(rc=proc.returncode, timed_out=time.perf_counter() - t >= timeout_s,
               wall_s=round(time.perf_counter() - t, 2), log_tail=log[-2000:])
    if out.exists():
        row["result"] = json.loads(out.read_text())
    print(f"--- {part.name}: rc {proc.returncode}, {row['wall_s']:.1f} s\n" + "\n".join(log.splitlines()[-6:]),
          flush=True)
    return row


def goals(done: dict, quick: bool) -> list[dict]:
    """Each goal of docs/experiments.md#accelerator-benchmark, with what was measured (None: not run)."""
    def get(part, *keys):
        x = done.get(part, {}).get("result")
        for k in keys:
            x = x.get(k) if isinstance(x, dict) else None
        return x

    rows = []
    for model, floor in (("1b", 0.97), ("135m", 0.99)) if not quick else (("tiny", 0.99),):
        ratio = get(f"learner_{model}_device", "ratio")
        rows.append({"goal": f"learner >= {floor}x plain, {model}, device encode", "measured": ratio,
                     "met": None if ratio is None else ratio >= floor})
        share = get(f"learner_{model}_device", "critical_host_share")
        rows.append({"goal": f"critical-path host work <= 1% of a step, {model}, device encode", "measured": share,
                     "met": None if share is None else share <= 0.01})
    top = max(get("syncer", "rounds") or [], key=lambda r: (r["values"], r["learners"]), default=None)
    round_s = None if top is None else top["round_s"]["median"]
    where = "38.8M values, M = 16" if top is None else f"{top['values'] / 1e6:.1f}M values, M = {top['learners']}"
    rows.append({"goal": f"syncer round <= 0.15 s, {where}", "measured": round_s,
                 "met": None if round_s is None else round_s <= 0.15})
    ratio = get("sim_vs_dp", "ratio")
    rows.append({"goal": "sim within 1.3x of data parallel", "measured": ratio,
                 "met": None if ratio is None else ratio <= 1.3})
    for model, floor in (("tiny", 0.0),) if quick else (("llama3_1b", 0.55), ("135m", 0.30)):
        best = max((r.get("mfu") or 0.0 for r in get(f"inner_step_{model}", "results") or []), default=None)
        rows.append({"goal": f"plain step MFU (6N) >= {floor:.0%}, {model}", "measured": best,
                     "met": None if not best else best >= floor})
    one = [r for r in get("decode", "results") or [] if r.get("batch") == 1]
    rate = one[0]["new_tokens_per_s"] if one else None
    rows.append({"goal": "batch-1 decode of the 135M shape >= 1,000 tokens/s", "measured": rate,
                 "met": None if rate is None or quick else rate >= 1000})
    identical = get("probe", "codec_check", "identical")
    rows.append({"goal": "device encoder's payload byte-identical to the host codec", "measured": identical,
                 "met": identical})
    return rows


def write(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)  # a reader never sees half a file


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny model, few steps: a smoke test on a CPU")
    p.add_argument("--budget", type=float, default=560.0, help="seconds for every part together")
    p.add_argument("--steps", type=int, default=None, help="learner steps per block (24; quick 4)")
    p.add_argument("--repeats", type=int, default=None, help="learner blocks (2; quick 1)")
    p.add_argument("--only", nargs="*", default=None, help="run only these parts")
    p.add_argument("--probe", action="store_true", help="(a part) the machine and the device encoder check")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.steps = args.steps or (4 if args.quick else 24)
    args.repeats = args.repeats or (1 if args.quick else 2)
    if args.probe:
        from accelerator_probe import probe

        write(Path(args.out), probe(args.quick))
        return
    path = Path(args.out) if args.out else RESULTS / "accelerator.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # One persistent compilation cache for every part (a model's host-encode run reuses its step).
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / "diloco-jax-cache"))
    todo = [x for x in parts(args) if args.only is None or x.name in args.only]
    result = {"args": vars(args), "jax_cache": os.environ["JAX_COMPILATION_CACHE_DIR"], "parts": {}}
    deadline = time.perf_counter() + args.budget
    with tempfile.TemporaryDirectory() as scratch:
        for i, part in enumerate(todo):
            left = deadline - time.perf_counter() - sum(x.reserve_s for x in todo[i + 1:])
            timeout = min(part.timeout_s, left)
            if timeout < 10:
                result["parts"][part.name] = {"skipped": f"{left:.0f} s of the budget left"}
            else:
                row = result["parts"][part.name] = run_part(part, timeout, Path(scratch))
                machine = row.get("result", {}).pop("machine", None)  # every part's; the probe's kept
                if part.name == "probe":
                    result["machine"], result["devices"] = machine, row.get("result", {}).get("devices")
            result["goals"] = goals(result["parts"], args.quick)
            write(path, result)
    for g in result["goals"]:
        print(f"{'met' if g['met'] else 'NOT met' if g['met'] is False else 'not run'}: {g['goal']}: {g['measured']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
