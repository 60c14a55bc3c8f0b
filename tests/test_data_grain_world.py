"""data=grain in a learner's world of P processes (docs/data.md#sharding): each process reads
every P-th record of the learner's order and packs its own rows; the processes' records are
disjoint and together make the step's batch; their positions resume exactly; a world of one is
the stream it always was. The 2-process world itself (jax.distributed over loopback, the rows
placed with world.global_batch, the positions gathered with world.all_gather) is the slow test
at the end; the rest run the processes' streams side by side in this process."""

import hashlib
import json
import logging

import numpy as np
import pytest
from test_data_grain import B, SEQ, grain_cfg, write_sets
from test_world import cache, finish, log_tail, spawn  # noqa: F401 - cache: the world children's XLA cache

from diloco.data import DataError, batch_share, load_corpus, train_batch
from diloco.data.pipeline import Order, document
from diloco.data.stream import for_process, restore_position, saved_position

# The batches of a world of one (learner 0 of 1 and learner 1 of 2, steps 0-3) as the stream made
# them before streams could be split across processes (commit 585198d). A change here changes
# every data=grain run's data: update it only on purpose, with the new value the assertion prints.
ONE_PROCESS_DIGEST = "97c7857a64d6190dcf021ef1ef723951"
KEYS = ("tokens", "segments", "positions", "targets")


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("grain-world")
    write_sets(root)
    return root


def corpus(root, **kw):
    return load_corpus(grain_cfg(root, ["d.jsonl", "d.parquet"], too_long="split", **kw))


def test_a_world_of_one_reads_the_stream_it_always_read(sets):
    train = corpus(sets).train
    assert train.in_world(1) is train and for_process(train, 0, 1) is train and batch_share(train) == 1
    h = hashlib.sha256()
    for m, M in ((0, 1), (1, 2)):
        for s in range(4):
            b = train_batch(train, seed=0, learner=m, num_learners=M, step=s, batch_size=B, seq_len=SEQ)
            for k in KEYS:
                h.update(np.ascontiguousarray(b[k]).tobytes())
    assert h.hexdigest()[:32] == ONE_PROCESS_DIGEST, f"the one-process stream changed: {h.hexdigest()[:32]}"
    assert isinstance(saved_position(train, 1, 2, 4)["data"], str)  # its checkpoints' form, as before
    train.close()


def test_two_processes_read_disjoint_records_that_together_make_the_batch(sets):
    whole = corpus(sets).train.in_world(2)
    mine = [for_process(corpus(sets).train, p, 2) for p in range(2)]
    assert whole.share == 1 and [t.share for t in mine] == [2, 2] and [t.parts for t in mine] == [(0,), (1,)]
    order = Order(0, 1, 2, whole.recipe.n_train)
    seen = [set(), set()]
    for s in range(6):
        parts = [t.batch_at(learner=1, num_learners=2, step=s, batch_size=B) for t in mine]
        assert all(len(b["tokens"]) == B // 2 for b in parts)  # each packs its share of the rows
        # the learner's batch is the processes' rows in process order (world.global_batch's layout)
        full = whole.batch_at(learner=1, num_learners=2, step=s, batch_size=B)
        for k in KEYS:
            np.testing.assert_array_equal(full[k], np.concatenate([b[k] for b in parts]), err_msg=k)
        ids = [t.records(learner=1, num_learners=2, step=s) for t in mine]
        assert not set(ids[0]) & set(ids[1]), f"step {s}: both processes read {set(ids[0]) & set(ids[1])}"
        assert np.array_equal(whole.records(learner=1, num_learners=2, step=s), np.union1d(*ids))
        for p in range(2):
            seen[p] |= set(ids[p].tolist())
    # process p reads the learner's order at positions p, p + 2, ...: its records are those
    firsts = [{order(k) for k in range(p, order.n, 2)} for p in range(2)]
    assert seen[0] <= firsts[0] and seen[1] <= firsts[1] and not seen[0] & seen[1]
    assert all(i % 2 == 1 for i in seen[0] | seen[1])  # still learner 1's shard of 2
    # a smaller batch (a learner short of slices): the first rows of each process's share
    small = whole.batch_at(learner=1, num_learners=2, step=2, batch_size=2)
    assert np.array_equal(small["tokens"], np.concatenate([t.batch_at(learner=1, num_learners=2, step=2,
                                                                      batch_size=2)["tokens"] for t in mine]))
    for t in (whole, *mine):
        t.close()


def test_every_token_of_the_world_batch_is_its_records_text(sets):
    """By record id: each segment of the learner's batch is a piece of the record its process
    says it read, so the processes' records are exactly what the step trains."""
    whole = corpus(sets).train.in_world(2)
    r = whole.recipe
    for s in range(3):
        for batch, docs in whole._made(learner=0, num_learners=2, step=s):
            tokens, seg = batch["tokens"], batch["segments"]
            for row in range(len(tokens)):
                for g in set(seg[row][seg[row] > 0].tolist()):
                    at = seg[row] == g
                    (rec,) = set(docs[row][at].tolist())
                    ids, text = tokens[row][at], document(r, rec).ids
                    assert any(np.array_equal(ids, text[k:k + len(ids)]) for k in range(0, len(text), r.width))
    whole.close()


def test_each_process_resumes_its_own_position_exactly(sets):
    mine = [for_process(corpus(sets).train, p, 2) for p in range(2)]
    want = [[t.records(learner=0, num_learners=2, step=s) for s in range(8)] for t in mine]
    states = [t.position(0, 2, 5) for t in mine]
    # what world.all_gather gives every process: each one's state, in process order
    metas = [saved_position(t, 0, 2, 5, lambda b: [s.encode() for s in states]) for t in mine]
    assert metas[0] == metas[1] == {"data": states}
    with pytest.raises(ValueError, match="gather"):
        saved_position(mine[0], 0, 2, 5)
    again = [for_process(corpus(sets).train, p, 2) for p in range(2)]
    for p, t in enumerate(again):
        restore_position(t, 0, 2, 5, metas[p])
        got = [t.records(learner=0, num_learners=2, step=s) for s in (5, 6, 7)]
        assert all(np.array_equal(a, b) for a, b in zip(got, want[p][5:]))
        assert min(t._feeds[(0, 2, p)].made) == 5  # taken up from its own state, not replayed
    # the learner's whole batch restores both
    whole = corpus(sets).train.in_world(2)
    restore_position(whole, 0, 2, 5, metas[0])
    assert np.array_equal(whole.records(learner=0, num_learners=2, step=6), np.union1d(want[0][6], want[1][6]))
    assert all(min(whole._feeds[(0, 2, p)].made) == 5 for p in range(2))
    for t in (*mine, *again, whole):
        t.close()


def test_a_checkpoint_of_another_world_size_is_replayed_with_a_warning(sets, caplog):
    one = corpus(sets).train
    one.records(learner=0, num_learners=2, step=2)  # the stream now knows its position at step 3
    saved = saved_position(one, 0, 2, 3)
    two = for_process(corpus(sets).train, 1, 2)
    want = for_process(corpus(sets).train, 1, 2).records(learner=0, num_learners=2, step=3)
    with caplog.at_level(logging.WARNING):
        restore_position(two, 0, 2, 3, saved)  # a world of one's state: the other split
    assert "a world of 1 process(es), and this world has 2" in caplog.text
    assert np.array_equal(two.records(learner=0, num_learners=2, step=3), want)
    assert not two._feeds[(0, 2, 1)].pinned and 0 in two._feeds[(0, 2, 1)].made  # replayed from the start
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        restore_position(one, 0, 2, 3, {"data": [json.dumps({}), json.dumps({})]})  # a world of two's
    assert "a world of 2 process(es), and this world has 1" in caplog.text
    restore_position(one, 0, 2, 3, {"versions": [0]})  # an older checkpoint: no position, no warning
    assert caplog.text.count("WARNING") == 1
    for t in (one, two):
        t.close()


def test_a_batch_or_a_shard_that_does_not_split_over_the_processes_is_an_error(tmp_path):
    write_sets(tmp_path, n=10)
    train = load_corpus(grain_cfg(tmp_path, ["d.jsonl"])).train  # 9 training records
    with pytest.raises(DataError, match=r"data.batch_size=4 is not divisible by the 3 processes"):
        train.in_world(3)
    with pytest.raises(DataError, match=r"learner 4's shard of data.paths holds 1 training records, fewer than "
                                        r"the 2 processes of its world"):
        train.check_learners(5, 2)
    train.check_learners(4, 2)
    with pytest.raises(DataError, match="a batch of 2 rows of learner 0 does not split over the 4 processes"):
        train.in_world(4, 1).batch_at(learner=0, num_learners=1, step=0, batch_size=2)
    train.close()


@pytest.mark.slow
def test_a_two_process_world_reads_disjoint_parts_builds_the_batch_and_resumes_exactly(tmp_path, cache):
    """Two processes of 4 CPU devices form learner 1's world (tests/world_child.py grain): each
    reads and packs only its own 4 of the 8 rows; the global batch world.global_batch builds from
    them, gathered, is the learner's batch; the checkpoint meta holds both positions on both
    processes; a fresh stream restored from it goes on record for record."""
    from diloco.runtime import world


    write_sets(tmp_path)
    steps, out, port = 6, tmp_path / "world", world.free_port()
    codes = finish([spawn("grain", i, 2, port, out, steps, cache) for i in range(2)], out)
    for i, code in enumerate(codes):
        assert code == 0, f"process {i} exited {code}:\n{log_tail(out, i)}"
    got = [json.loads((out / f"p{i}.json").read_text()) for i in range(2)]
    whole = load_corpus(grain_cfg(tmp_path, ["d.jsonl", "d.parquet"], too_long="split", batch_size=8)).train
    whole = whole.in_world(2)
    gathered = dict(np.load(out / "p0.npz"))
    assert got[0]["rows"] == got[1]["rows"] == 4
    for s in range(steps):
        mine = [set(g["records"][s]) for g in got]
        assert not mine[0] & mine[1], f"step {s}: both processes read records {mine[0] & mine[1]}"
        assert sorted(mine[0] | mine[1]) == whole.records(learner=1, num_learners=2, step=s).tolist()
        want = whole.batch_at(learner=1, num_learners=2, step=s, batch_size=8)
        for k in KEYS:
            np.testing.assert_array_equal(gathered[f"{k}{s}"], want[k], err_msg=f"{k} at step {s}")
    assert not set().union(*got[0]["records"]) & set().union(*got[1]["records"])  # within the first pass
    meta = got[0]["meta"]
    assert meta == got[1]["meta"] and isinstance(meta["data"], list) and len(meta["data"]) == 2
    for g in got:
        assert g["taken_up"] and g["resumed"] == g["records"][steps // 2:]
    whole.close()


@pytest.mark.slow
def test_a_procs_learner_world_checkpoints_every_process_position_and_rejoins_from_them(tmp_path):
    """procs, one learner of 2 processes x 4 CPU devices reading data=grain: every step books the
    learner's whole batch (both processes' rows), each checkpoint's meta holds both processes'
    positions, a kill -9 of the follower brings the world back as incarnation 1, which rejoins from
    them, and the run finishes with the ledger balanced."""
    from dataclasses import replace

    from conftest import alongside, diloco_world, kill_after_first_checkpoint, tiny_cfg

    from diloco.config import WorldConfig, validate
    from diloco.runtime import procs

    write_sets(tmp_path, n=300)
    steps = 12
    cfg = tiny_cfg(tmp_path, "procs", run=dict(steps=steps, eval_every=steps),
                   data=dict(source="grain", paths=(str(tmp_path / "d.jsonl"),), too_long="split", batch_size=8),
                   runtime=dict(learners=1, devices_per_learner=8, learner_checkpoint_every=4, restart_s=0.5,
                                step_period_s=0.25, max_rejoin_staleness=1000))
    cfg = validate(replace(cfg, runtime=replace(cfg.runtime, world=WorldConfig(processes_per_learner=2,
                                                                               heartbeat_s=3.0))))
    _, _, setup, _, _ = diloco_world(cfg)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    killed = []
    killer = kill_after_first_checkpoint(run_dir, 0, killed, pid=lambda record: record["pids"][1])  # the follower
    rt, summary = alongside(killer, lambda: procs.run(cfg, setup, run_dir, None))
    assert killed == [0] and [(r["learner"], r["incarnation"]) for r in rt.rejoins] == [(0, 1)]
    assert rt.rejoins[0]["restored_from"] is not None  # from a checkpoint, and so from its positions
    assert rt.finished["complete"] and rt.finished["steps"] == {"0": steps}
    assert summary["token_ledger_imbalance"] == 0
    # each booked step is the learner's 8 rows, though each process packed 4 of them
    per_step = cfg.data.batch_size * cfg.data.seq_len
    processed = rt.finished["tokens"]["processed"]
    assert processed == cfg.fragments.count * steps * per_step, (processed, per_step)
    metas = {}
    for d in (run_dir / "learners" / "learner-0").iterdir():
        for f in d.rglob("*") if d.name.isdigit() else []:
            if f.is_file() and f.suffix in ("", ".json") and b'"versions"' in f.read_bytes()[:100_000]:
                metas[int(d.name)] = json.loads(f.read_text())
    assert metas and all(isinstance(m.get("data"), list) and len(m["data"]) == 2 for m in metas.values()), metas
    step, meta = max(metas.items())
    # the saved positions give each process's own part of the learner's stream at that step
    whole = load_corpus(cfg.data).train.in_world(2)
    restored = load_corpus(cfg.data).train.in_world(2)
    restore_position(restored, 0, 1, step, meta)
    assert np.array_equal(restored.records(learner=0, num_learners=1, step=step),
                          whole.records(learner=0, num_learners=1, step=step))
    assert all(min(restored._feeds[(0, 1, p)].made) == step for p in range(2))
    whole.close()
    restored.close()


def test_the_run_reads_the_stream_as_its_worlds_do_and_checks_the_shards_at_start_up(tmp_path):
    """load_inputs: with runtime.world.processes_per_learner = P the run's stream is the worlds'
    (every process's rows of each batch), and a shard with fewer records than P is an error there."""
    from dataclasses import replace

    from conftest import tiny_cfg

    from diloco.config import WorldConfig, validate
    from diloco.inputs import load_inputs

    write_sets(tmp_path, n=10)  # 9 training records

    def cfg(learners):
        c = tiny_cfg(tmp_path, "procs", data=dict(source="grain", paths=(str(tmp_path / "d.jsonl"),), batch_size=8),
                     runtime=dict(learners=learners, devices_per_learner=2))
        return validate(replace(c, runtime=replace(c.runtime, world=WorldConfig(processes_per_learner=2))))

    train = load_inputs(cfg(2), weights=False).corpus.train
    assert (train.recipe.processes, train.recipe.process, train.share) == (2, -1, 1)
    with pytest.raises(DataError, match="learner 4's shard of data.paths holds 1 training records, fewer than the 2"):
        load_inputs(cfg(5), weights=False)
