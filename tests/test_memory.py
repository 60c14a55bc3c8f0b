"""Memory over a run and before it (docs/design.md#syncer-memory, #memory-before-a-run): the
syncer keeps only the references learners can still use, resident memory stops climbing once a
full-model sim run is under way, and a run that cannot fit is refused at start."""

import functools
import multiprocessing
import platform
import subprocess
import sys
from dataclasses import replace

import pytest
from scipy.stats import theilslopes

from diloco.algo import hostpool
from diloco.config import (ConfigError, DataConfig, FragmentsConfig, InnerConfig, ModelConfig, RunConfig, RuntimeConfig,
                           TrainConfig, validate)
from diloco.config import load as load_config
from diloco.data import load_corpus
from diloco.experiments.spec import _compose
from diloco.model import build as build_model
from diloco.model import count_params
from diloco.runtime import build as setup_mod
from diloco.runtime import sim as simrt
from diloco.train import footprint

MIB = 1 << 20
GIB = 1 << 30


def rss() -> int:
    """This process's resident memory in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def make_cfg(tmp, steps: int, d_model: int, H: int) -> TrainConfig:
    """Full-model Decoupled DiLoCo in sim as the README's fine-tune runs it (4 learners of 2
    devices, int4 up, int8 down, Nesterov, syncer.history 16), at a small model's size."""
    model = ModelConfig(name="m", d_model=d_model, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=3 * d_model,
                        max_seq_len=64)
    data = DataConfig(source="synthetic", seq_len=32, batch_size=2, data_dir=str(tmp / "data"),
                      synthetic_vocab=256, synthetic_tokens=100_000)
    run = RunConfig(steps=steps, log_every=0, eval_every=0, eval_batches=1, out_dir=str(tmp / "run"),
                    progress=False, plot=False, checkpoint_every=0)
    return validate(TrainConfig(model=model, data=data, run=run, algo="diloco", inner=InnerConfig(warmup_steps=2),
                                fragments=FragmentsConfig(count=4, H=H, tau=2),
                                runtime=RuntimeConfig(learners=4, devices_per_learner=2)))


def run_sim(cfg: TrainConfig, tmp, every_step=None):
    corpus = load_corpus(cfg.data)
    model = build_model(cfg.model, corpus.vocab_size, seed=0)
    setup = setup_mod.build(cfg, corpus, model)
    (tmp / "run").mkdir(parents=True, exist_ok=True)
    seen = [-1]

    def stop(sim):
        step = sim.steps_done // cfg.runtime.learners
        if step != seen[0] and every_step is not None:
            seen[0] = step
            every_step(sim, step)
        return False

    sim, _ = simrt.run(cfg, setup, tmp / "run", None, stop)
    return sim, count_params(model.params)


def test_the_syncer_keeps_only_the_references_learners_can_use(tmp_path):
    """Each learner sends a fragment every step (H = P = 4), so each fragment merges 8 times in 32
    steps, all of them inside syncer.history (16); what learners can still be based on is a version
    or two behind the newest."""
    cfg = make_cfg(tmp_path, steps=32, d_model=32, H=4)
    kept = []
    sim, _ = run_sim(cfg, tmp_path, lambda sim, step: kept.append(max(len(fs.refs) for fs in sim.host.state.fragments)))
    versions = [fs.version for fs in sim.host.state.fragments]
    assert min(versions) >= 2 * cfg.runtime.learners  # every version would be kept: history is 16
    assert max(kept[len(kept) // 2:]) < cfg.runtime.learners, (kept, versions)  # 2 measured


def _rss_over_a_run(tmp) -> tuple[list[tuple[int, int]], int]:
    """(step, RSS) after every step of 96 of a 3.2M-parameter model, and its parameter count."""
    hostpool._TRIM_EVERY_S = 0.0  # every step: the slope, not the sawtooth (this process only)
    cfg = make_cfg(tmp, steps=96, d_model=256, H=24)
    samples = []
    _, params = run_sim(cfg, tmp, lambda sim, step: samples.append((step, rss())))
    return samples, params


@pytest.mark.slow  # 96 steps in a process of its own; RSS moves +-50 MB step to step, so 48 were too few
def test_resident_memory_stops_growing(tmp_path):
    """RSS over the last third of 96 steps of a 3.2M-parameter model grows by less than a tenth
    of the model's float32 size per step (it climbed 450 MB, 37 model copies, in 96 steps before
    the heap's free pages were handed back and the references bounded). Measured in a process of
    its own: what earlier tests leave in this one (their compiled programs, the arenas of the
    host pool's threads) is not the run's. Over steps 24-48 the slope was still 2.5-3 MB a step,
    so the fit starts at step 48. RSS wanders +-30 MB over a few steps: a least-squares line over
    the last third measured -0.7 and +1.7 MB a step in two runs of the same code (this test then
    failed), the Theil-Sen slope (the median of pairwise slopes) over the last half -0.2 and +0.3."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        samples, params = pool.apply(_rss_over_a_run, (tmp_path,))
    half = samples[len(samples) // 2:]
    slope = theilslopes([r for _, r in half], [s for s, _ in half])[0]
    model = 4 * params
    assert slope < 0.1 * model, f"{slope / MIB:.2f} MB per step, model {model / MIB:.1f} MB: {samples}"


def test_release_freed_at_most_once_per_interval(monkeypatch):
    monkeypatch.setattr(hostpool, "_TRIMMED", [float("-inf")])
    assert hostpool.release_freed(100.0)
    assert not hostpool.release_freed(100.0 + hostpool._TRIM_EVERY_S / 2)
    assert hostpool.release_freed(100.0 + hostpool._TRIM_EVERY_S)
    assert hostpool.release_freed(100.0 + hostpool._TRIM_EVERY_S, force=True)  # a run's memory check


def test_the_host_estimate_counts_learners_the_syncer_and_the_devices(tmp_path):
    cfg = make_cfg(tmp_path, steps=8, d_model=256, H=24)
    P = 3_000_000
    one = footprint.host_estimate(replace(cfg, runtime=replace(cfg.runtime, learners=1)), P, 256)
    four = footprint.host_estimate(cfg, P, 256)
    # 4 learners hold 4 states; sim steps them in turn, so one step's transients
    assert four.parts["learner states"] == pytest.approx(4 * one.parts["learner states"])
    assert four.parts["a step"] == pytest.approx(one.parts["a step"])
    threads = footprint.host_estimate(replace(cfg, runtime=replace(cfg.runtime, kind="threads")), P, 256)
    assert threads.parts["a step"] == pytest.approx(4 * one.parts["a step"])
    # on an accelerator the devices' memory is not the host's
    assert "learner states" not in footprint.host_estimate(cfg, P, 256, platform="gpu").parts
    # the syncer: Theta, Nesterov's momentum, a round's sums, Theta_0 and M + 1 references (the last
    # merged delta only with the outer statistics: tests/test_outer_stats_switch.py)
    assert four.parts["syncer"] == pytest.approx(4.0 * P * (4 + 4 + 1))
    # LoRA: each learner's state is its adapters; the frozen checkpoint is one copy on sim's one
    # mesh, and one per learner where each has devices of its own
    lora = dict(trained=P // 100)
    sim_lora, threads_lora = (footprint.host_estimate(c, P, 256, **lora)
                              for c in (cfg, replace(cfg, runtime=replace(cfg.runtime, kind="threads"))))
    devices = cfg.runtime.devices_per_learner
    assert sim_lora.parts["frozen weights"] == pytest.approx(devices * 4.0 * (P - P // 100))
    assert threads_lora.parts["frozen weights"] == pytest.approx(4 * sim_lora.parts["frozen weights"])
    assert sim_lora.parts["learner states"] < four.parts["learner states"] / 20


@functools.cache
def _procs_base() -> TrainConfig:
    return load_config(_compose("train", [
        "model=135m", "data=synthetic", "data.batch_size=2", "data.seq_len=64", "runtime.kind=procs",
        "runtime.devices_per_learner=1", "fragments.H=2", "fragments.count=2", "fragments.tau=1",
        "run.out_dir=runs/test"]))


def _procs_full_finetune(layers: int, learners: int = 2, **runtime) -> TrainConfig:
    """The measured procs runs: a 135m-shaped model of `layers` layers, one device a learner,
    batch 2 x 64, two fragments (docs/design.md#memory-before-a-run)."""
    cfg = _procs_base()
    return replace(cfg, model=replace(cfg.model, n_layers=layers),
                   runtime=replace(cfg.runtime, learners=learners, **runtime))


def test_procs_counts_a_runtime_and_copies_per_process_against_what_was_measured():
    """Each procs child is a process of its own. Golden figures, peak PSS summed over a run's
    processes on the 2-core CPU machine (2026-12-05): 8.05-8.66 GiB with 12 layers (42.9M
    parameters, vocabulary 256), and above 20.3 GiB for SmolLM2-135M (the kernel killed a learner
    there). To update: rerun those runs and the numbers in docs/design.md#memory-before-a-run."""
    P12, P135 = int(0.16 * GIB / 4), 134_515_008
    procs = footprint.host_estimate(_procs_full_finetune(12), P12, 256)
    threads = footprint.host_estimate(_procs_full_finetune(12, kind="threads"), P12, 256)
    extra = set(procs.parts) - set(threads.parts)
    assert extra == {"runtimes of the M + 1 children", "per-process copies"}
    assert procs.parts["runtimes of the M + 1 children"] == 3 * footprint.RUNTIME_BYTES
    assert 8.66 * GIB <= procs.total <= 1.3 * 8.05 * GIB
    smollm2 = footprint.host_estimate(_procs_full_finetune(30), P135, 49152)
    assert smollm2.total > 20.3 * GIB
    four = footprint.host_estimate(_procs_full_finetune(30, learners=4), P135, 49152)
    assert four.parts["per-process copies"] - smollm2.parts["per-process copies"] == pytest.approx(
        2 * footprint.PROCESS_COPIES["learner"] * 4.0 * P135)
    # started apart, each process is checked where it starts, not the machine's sum here
    apart = footprint.host_estimate(_procs_full_finetune(12, launch="external"), P12, 256)
    assert not extra & set(apart.parts)
    # off the CPU the devices hold the states: only the runtimes were measured to add
    assert "per-process copies" not in footprint.host_estimate(_procs_full_finetune(12), P12, 256, platform="gpu").parts


def test_a_run_that_cannot_fit_is_refused_naming_the_knobs(tmp_path):
    cfg = make_cfg(tmp_path, steps=8, d_model=256, H=24)
    need = footprint.host_estimate(cfg, 100_000_000, 256).total
    lines = footprint.preflight(cfg, 100_000_000, 256, None, "cpu", int(need / footprint.MARGIN) + 1)
    assert lines[0].startswith("memory: about")
    with pytest.raises(footprint.MemoryRefused) as err:
        footprint.preflight(cfg, 100_000_000, 256, None, "cpu", int(need))
    for knob in ("runtime.learners=4", "runtime.devices_per_learner=2", "data.batch_size=2", "finetune=lora",
                 "model.remat", "run.memory_check=false"):
        assert knob in str(err.value)
    off = replace(cfg, run=replace(cfg.run, memory_check=False))
    assert footprint.preflight(off, 100_000_000, 256, None, "cpu", int(need))  # printed, not refused


def test_run_refuses_before_writing_anything(tmp_path, monkeypatch):
    """diloco.run checks the estimate after the data and the model are loaded and before the run
    directory is made: a refusal leaves nothing behind."""
    from diloco import run as drun

    cfg = make_cfg(tmp_path, steps=4, d_model=32, H=4)
    read = []  # what earlier runs in the process freed is handed back before the memory is read
    monkeypatch.setattr(hostpool, "release_freed", lambda force=False: read.append(f"released {force}"))
    monkeypatch.setattr(footprint, "mem_available", lambda: read.append("read") or 64 * MIB)
    with pytest.raises(ConfigError, match="run.memory_check=false"):
        drun.run(cfg)
    assert not (tmp_path / "run").exists() and read == ["released True", "read"]


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's heap")
def test_memory_a_run_freed_is_handed_back_before_the_next_runs_check():
    """glibc keeps freed blocks under its mmap threshold in its heap, where MemAvailable does not see
    them: a study process still held 10 GiB of a finished full-model run and refused the next.
    The forced trim before a run's memory check hands them back: in a fresh process, 200 MB freed as
    holes in the heap."""
    code = """
import numpy as np
from diloco.algo import hostpool
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024
big = np.ones(4 << 20, np.uint8); del big  # a freed mmapped block raises glibc's mmap threshold past 4 MB
blocks = [np.ones(1 << 20, np.uint8) for _ in range(400)]  # so these come from the heap
keep = blocks[1::2]; del blocks  # every other one freed: holes, not the heap's top, which glibc trims itself
before = rss(); hostpool.release_freed(force=True); print(before - rss())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) >= 150  # MB of the 200 freed
