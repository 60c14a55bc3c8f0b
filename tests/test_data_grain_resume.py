"""data=grain across a learner's death (docs/data.md#resume): the threads runtime kills learner 1
mid-run; its next incarnation restores its stream from the checkpoint's iterator state and
trains, record by record, what the stream holds from the step where the dead one stopped on. procs: a kill -9 of a learner
process, whose checkpoints carry the state. Slow: real runs (80 s and 140 s here)."""

import json

import numpy as np
import pytest
from conftest import alongside, diloco_world, kill_after_first_checkpoint, tiny_cfg
from test_data_grain import write_sets

from diloco.runtime import threads
from diloco.runtime.unit import LearnerUnit

STEPS, KILL_AT, EVERY = 30, 12, 5


@pytest.mark.slow
def test_a_killed_learner_resumes_its_shard_where_its_checkpoint_says(tmp_path, monkeypatch):
    write_sets(tmp_path, n=300)
    cfg = tiny_cfg(tmp_path, "threads", run=dict(steps=STEPS, eval_every=STEPS),
                   data=dict(source="grain", paths=(str(tmp_path / "d.jsonl"), str(tmp_path / "d.parquet")),
                             too_long="split", batch_size=8),
                   runtime=dict(restart_s=0.2, learner_checkpoint_every=EVERY, max_rejoin_staleness=1000))
    corpus, _, setup, _, _ = diloco_world(cfg)
    train = corpus.train
    rt = threads.Threads(cfg, setup, None, None, None, tmp_path / "learners")
    trained: dict[tuple[int, int], list[tuple[int, np.ndarray]]] = {}
    plain_step = LearnerUnit.step

    def step(unit, *args, **kwargs):
        at = unit.ls.step
        ids = train.records(learner=unit.learner, num_learners=2, step=at)
        trained.setdefault((unit.learner, unit.ls.incarnation), []).append((at, ids))
        if unit.learner == 1 and unit.ls.incarnation == 0 and at == KILL_AT:
            rt.kill(1)
        return plain_step(unit, *args, **kwargs)
    monkeypatch.setattr(LearnerUnit, "step", step)
    summary = rt.run()
    restored = (KILL_AT // EVERY) * EVERY
    resumed = KILL_AT + 1  # where incarnation 0 stopped, not the checkpoint's step
    assert [(r.learner, r.incarnation, r.restored_from, r.step) for r in rt.rejoins] == [(1, 1, restored, resumed)]
    # the checkpoint carried the iterator state, and the rejoin handed it to the stream
    assert restored in train._feeds[(1, 2, 0)].pinned

    # The same stream, made afresh from nothing but the data: what each step should train.
    fresh = type(train)(train.recipe)
    want = {m: [fresh.records(learner=m, num_learners=2, step=s) for s in range(STEPS)] for m in range(2)}
    steps = {k: [s for s, _ in v] for k, v in trained.items()}
    assert steps[(0, 0)] == list(range(STEPS))
    assert steps[(1, 0)] == list(range(resumed)) and steps[(1, 1)] == list(range(resumed, STEPS))
    for (m, _), got in trained.items():
        for s, ids in got:
            assert (ids == want[m][s]).all(), f"learner {m} step {s} trained other records"
    # Record ids: learner 1's stream (incarnation 0's steps, then incarnation 1's) is its shard's
    # stream, none twice and none skipped; shards stay disjoint.
    survived = [ids for _, ids in trained[(1, 0)]] + [ids for _, ids in trained[(1, 1)]]
    assert np.array_equal(np.concatenate(survived), np.concatenate(want[1]))
    assert not set(np.concatenate(survived).tolist()) & set(np.concatenate(want[0]).tolist())
    # The ledger: balanced, every token processed once. Of incarnation 0's steps after its last
    # send, the tokens are booked lost (its unsent progress); nothing is trained twice, so what
    # was sent and merged is in Theta once.
    per_step = cfg.data.batch_size * cfg.data.seq_len
    assert summary["token_ledger_imbalance"] == 0
    assert rt.tokens.processed == ((STEPS + STEPS) * per_step,) * cfg.fragments.count
    assert all(0 < lost <= resumed * per_step for lost in rt.tokens.lost), rt.tokens.lost
    train.close()
    fresh.close()


@pytest.mark.slow
def test_a_killed_learner_process_saves_and_takes_up_its_stream_position(tmp_path):
    """procs: kill -9 of learner 1's process once it has checkpointed; its checkpoints carry its
    stream's iterator state, which gives the stream's own batch at that step, and the restarted
    incarnation finishes the run with the ledger balanced."""
    from diloco.runtime import procs

    write_sets(tmp_path, n=300)
    cfg = tiny_cfg(tmp_path, "procs", run=dict(steps=20),
                   data=dict(source="grain", paths=(str(tmp_path / "d.jsonl"),), too_long="split", batch_size=8),
                   runtime=dict(speeds=(1.0, 3.0), learner_checkpoint_every=4, restart_s=1.0))
    corpus, _, setup, _, _ = diloco_world(cfg)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    killed = []
    rt, summary = alongside(kill_after_first_checkpoint(run_dir, 1, killed), lambda: procs.run(cfg, setup, run_dir, None))
    assert killed == [0] and [(r["learner"], r["incarnation"]) for r in rt.rejoins] == [(1, 1)]
    assert rt.finished["complete"] and rt.finished["steps"] == {"0": 20, "1": 20}
    assert summary["token_ledger_imbalance"] == 0
    metas = {}
    for d in (run_dir / "learners" / "learner-1").iterdir():
        for f in d.rglob("*") if d.name.isdigit() else []:
            if f.is_file() and f.suffix in ("", ".json") and b'"versions"' in f.read_bytes()[:100_000]:
                metas[int(d.name)] = json.loads(f.read_text())
    assert metas and all(isinstance(m.get("data"), str) for m in metas.values()), metas
    step, meta = max(metas.items())
    fresh = type(corpus.train)(corpus.train.recipe)
    fresh.restore(1, 2, step, meta["data"])
    replayed = type(corpus.train)(corpus.train.recipe)
    assert (fresh.records(learner=1, num_learners=2, step=step)
            == replayed.records(learner=1, num_learners=2, step=step)).all()
    assert min(fresh._feeds[(1, 2, 0)].made) == step  # taken up from the saved state
    for t in (fresh, replayed, corpus.train):
        t.close()


@pytest.mark.slow
def test_a_resumed_data_parallel_run_takes_up_its_stream_and_matches_an_uninterrupted_one(tmp_path):
    """run.resume=true of the data-parallel trainer: its checkpoint carries the stream's position,
    which the resumed run restores (no replay), and 6 + 6 steps equal 12, exactly."""
    from dataclasses import replace
    from pathlib import Path

    import jax

    from diloco.data import load_corpus
    from diloco.model import build
    from diloco.train.mesh import make_mesh
    from diloco.train.trainer import train_dp

    write_sets(tmp_path, n=200)

    def cfg(name):
        return tiny_cfg(tmp_path / name, algo="dp", run={"checkpoint_every": 6, "steps": 12, "eval_every": 6},
                        data=dict(source="grain", paths=(str(tmp_path / "d.parquet"),), batch_size=8))
    straight, half = cfg("a"), cfg("b")
    mesh = make_mesh(straight.mesh, 8)
    corpus = load_corpus(straight.data)
    model = build(straight.model, corpus.vocab_size, seed=0)
    full, _ = train_dp(straight, corpus, model, mesh, Path(straight.run.out_dir))
    first, _ = train_dp(half, load_corpus(half.data), model, mesh, Path(half.run.out_dir), stop=lambda s: s == 6)
    again = load_corpus(half.data)
    resumed, _ = train_dp(replace(half, run=replace(half.run, resume=True)), again, model, mesh, Path(half.run.out_dir))
    assert int(first.step) == 6 and int(resumed.step) == 12
    feed = again.train._feeds[(0, 1, 0)]
    assert 6 in feed.pinned and min(feed.made) >= 6 and 0 not in feed.made  # taken up at step 6
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
