"""data=grain (docs/data.md): every format read, shards disjoint by record id, packed rows with
segments, bad input named at start-up, and a restored iterator position giving the same stream."""

import json
from dataclasses import replace

import numpy as np
import pytest

from diloco.config import DataConfig
from diloco.data import DataError, load_corpus, train_batch
from diloco.data.pipeline import Feed

SEQ, B = 32, 4


def write_sets(root, n=120, seed=0):
    """A JSONL, a Parquet (row groups of 16), a text and an ArrayRecord file (text records) of
    documents `name i` plus filler of random length: the tests' small sets, never downloaded."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from array_record.python.array_record_module import ArrayRecordWriter

    rng = np.random.default_rng(seed)
    docs = {k: [f"{k} {i} " + "ab" * int(rng.integers(2, 40)) for i in range(n)] for k in ("j", "p", "t", "a")}
    (root / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs["j"]))
    pq.write_table(pa.table({"text": docs["p"]}), root / "d.parquet", row_group_size=16)
    (root / "d.txt").write_text("\n".join(docs["t"]) + "\n")
    w = ArrayRecordWriter(str(root / "d.array_record"), "group_size:8")
    for d in docs["a"]:
        w.write(d.encode())
    w.close()
    return docs


def grain_cfg(root, paths, **kw):
    return DataConfig(**{"source": "grain", "paths": tuple(str(root / p) for p in paths), "seq_len": SEQ,
                         "batch_size": B, "data_dir": str(root / "data"), "record": "text", **kw})


def records(train, m, M, steps):
    return [train.records(learner=m, num_learners=M, step=s) for s in range(steps)]


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("grain")
    return root, write_sets(root)


@pytest.mark.parametrize("path", ["d.jsonl", "d.parquet", "d.txt", "d.array_record"])
def test_each_format_reads_its_documents_into_packed_rows(sets, path):
    root, docs = sets
    c = load_corpus(grain_cfg(root, [path]))
    b = train_batch(c.train, seed=0, learner=0, num_learners=1, step=0, batch_size=B, seq_len=SEQ)
    assert b["tokens"].shape == b["segments"].shape == b["positions"].shape == (B, SEQ + 1)
    text = bytes(b["tokens"][0][b["segments"][0] == 1].astype(np.uint8)).decode()
    kind = path.split(".")[1][0]
    assert any(d[:SEQ + 1] == text for d in docs[kind])  # a document (truncated to a row)
    seg, pos = b["segments"], b["positions"]
    starts = (seg > 0) & np.concatenate([np.ones((B, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    assert (pos[starts] == 0).all() and (pos[(seg > 0) & ~starts] > 0).all()
    # no target across a document boundary or into padding
    assert not (b["targets"] & (seg[:, 1:] != seg[:, :-1])).any() and not (b["targets"] & (seg[:, 1:] == 0)).any()
    assert c.val.tokens.shape[1] == SEQ + 1 and c.vocab_size == 256
    c.train.close()


def test_learners_read_disjoint_deterministic_shards_that_cover_the_train_records(sets):
    root, docs = sets
    cfg = grain_cfg(root, ["d.jsonl"], too_long="truncate")
    c, again = load_corpus(cfg), load_corpus(cfg)
    M, steps = 3, 12
    mine = [np.concatenate(records(c.train, m, M, steps)) for m in range(M)]
    for m in range(M):
        assert (mine[m] % M == m).all()  # record j is learner j mod M's
        assert len(np.unique(mine[m])) == len(mine[m]) or len(mine[m]) > c.train.recipe.n_train // M
    n_train = c.train.recipe.n_train
    seen = set(np.concatenate(mine).tolist())
    assert seen <= set(range(n_train))  # held-out records never train
    # a learner's first pass covers its shard before any record comes back
    first = [np.concatenate(records(c.train, 0, M, s)) for s in range(1, steps + 1)]
    shard = set(range(0, n_train, M))
    whole = next(f for f in first if set(f.tolist()) >= shard)
    assert len(whole) - len(np.unique(whole)) < B * 8  # repeats only from the next pass's last batch
    for m in range(M):  # the same stream from a second load, and a different one under another seed
        assert all((a == b).all() for a, b in zip(records(again.train, m, M, 4), records(c.train, m, M, 4)))
    other = load_corpus(cfg, seed=1)
    assert any(set(a) != set(b) for a, b in zip(records(other.train, 0, M, 4), records(c.train, 0, M, 4)))
    for x in (c, again, other):
        x.train.close()


def test_long_documents_are_split_truncated_or_dropped_as_configured(tmp_path, caplog):
    (tmp_path / "long.jsonl").write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in (100, 10, 100, 10) * 4))

    def trained(too_long):
        c = load_corpus(grain_cfg(tmp_path, ["long.jsonl"], too_long=too_long, record="tokens"))
        b = train_batch(c.train, seed=0, learner=0, num_learners=1, step=0, batch_size=B, seq_len=SEQ)
        lengths = [np.bincount(row[row > 0]).max() for row in b["segments"]]
        c.train.close()
        return max(lengths)

    assert trained("split") == SEQ + 1 and trained("truncate") == SEQ + 1
    assert trained("drop") == 10  # only the short documents are left
    assert "of the first 16 records of data.paths' files, 0 are skipped as bad (data.on_bad=skip) and 8 dropped" \
        in caplog.text


def test_a_restored_position_gives_the_same_batches_without_replaying(sets):
    root, _ = sets
    cfg = grain_cfg(root, ["d.parquet", "d.jsonl"])
    c = load_corpus(cfg)
    want = [c.train.records(learner=1, num_learners=2, step=s) for s in range(9)]
    state = c.train.position(1, 2, 6)  # what a checkpoint at step 6 saves
    assert isinstance(json.loads(state), dict)
    fresh = load_corpus(cfg).train
    fresh.restore(1, 2, 6, state)
    got = [fresh.records(learner=1, num_learners=2, step=s) for s in (6, 7, 8)]
    assert all((a == b).all() for a, b in zip(got, want[6:]))
    feed: Feed = fresh._feeds[(1, 2, 0)]
    assert min(feed.made) == 6  # read from the restored state on, not replayed from step 0
    # a state of another pipeline (other workers, other files) is replayed from the start instead
    c.train.close()
    fresh.close()
    other = load_corpus(cfg).train
    other.restore(1, 2, 6, json.dumps({"junk": 1}))
    assert (other.records(learner=1, num_learners=2, step=6) == want[6]).all()
    other.close()


@pytest.mark.parametrize("case", ["column", "parquet", "arrayrecord", "empty", "learners", "field", "vocab",
                                  "url"])
def test_bad_input_is_one_error_naming_the_file_and_the_fix(tmp_path, case):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_sets(tmp_path, n=10)
    paths, kw, want = ["d.parquet"], {}, ""
    if case == "column":
        pq.write_table(pa.table({"body": ["a b c"] * 4}), tmp_path / "x.parquet")
        paths, want = ["x.parquet"], "x.parquet: no column 'text' (columns: ['body']); set data.text_field"
    elif case == "parquet":
        (tmp_path / "x.parquet").write_bytes(b"PAR1 not really")
        paths, want = ["d.parquet", "x.parquet"], "x.parquet: not a readable Parquet file"
    elif case == "arrayrecord":
        raw = (tmp_path / "d.array_record").read_bytes()
        (tmp_path / "x.array_record").write_bytes(raw[: len(raw) // 2])  # cut short
        paths, want = ["x.array_record"], "x.array_record holds no records (empty, or cut short"
    elif case == "empty":
        (tmp_path / "x.jsonl").write_text("\n\n")
        paths, want = ["d.jsonl", "x.jsonl"], "x.jsonl holds no records"
    elif case == "learners":
        want = "data.paths holds 9 training records (10 in all, the last 1 held out), fewer than the 12 learners"
    elif case == "field":
        (tmp_path / "x.jsonl").write_text(json.dumps({"body": "hi"}) + "\n")
        paths = ["d.jsonl", "x.jsonl"]
        want = "x.jsonl: line 1: no string field 'text' (found ['body']); set data.text_field"
    elif case == "vocab":
        from array_record.python.array_record_module import ArrayRecordWriter

        w = ArrayRecordWriter(str(tmp_path / "x.array_record"), "group_size:8")
        for _ in range(4):
            w.write(np.asarray([1, 2, 300, 4], "<i4").tobytes())
        w.close()
        paths, kw, want = ["x.array_record"], {"record": "tokens"}, "x.array_record: record 0: token ids span [1, 300]"
    else:
        paths, want = ["hdfs://bucket/x.parquet"], "data=grain reads local paths, file://, s3:// or gs:// URLs"
    cfg = grain_cfg(tmp_path, paths, **kw)
    if case == "url":
        cfg = replace(cfg, paths=("hdfs://bucket/x.parquet",))
    with pytest.raises(DataError) as err:
        c = load_corpus(cfg)
        c.train.check_learners(12)
    assert want in str(err.value)


@pytest.mark.slow  # 17 s on a loaded 2-core machine (three compiles); tests/test_attention.py pins the mask
def test_packed_pretraining_rows_do_not_attend_across_documents(sets):
    """The path a grain batch takes (the packed rows' loss, diloco/train/trainer.py compile_steps):
    a document's logits in a packed row are those of the document alone."""
    from conftest import tiny_model

    from diloco.model import build

    model = build(replace(tiny_model(), max_seq_len=SEQ + 1), 256, 0)
    a, b = np.arange(5, 17, dtype=np.int32), np.arange(40, 60, dtype=np.int32)
    row = np.concatenate([a, b])[None]
    seg = np.concatenate([np.full(len(a), 1), np.full(len(b), 2)]).astype(np.int32)[None]
    pos = np.concatenate([np.arange(len(a)), np.arange(len(b))]).astype(np.int32)[None]
    packed = np.asarray(model.packed(model.params, row, seg, pos))
    alone = np.asarray(model.packed(model.params, b[None], np.ones((1, len(b)), np.int32),
                                    np.arange(len(b), dtype=np.int32)[None]))
    np.testing.assert_allclose(packed[0, len(a):], alone[0], atol=2e-5)
    joined = np.asarray(model.packed(model.params, row, np.ones_like(seg),
                                     np.arange(row.shape[1], dtype=np.int32)[None]))
    assert np.abs(joined[0, len(a):] - alone[0]).max() > 1e-3  # without segments it would differ


def test_chat_messages_in_parquet_are_rendered_packed_and_masked_to_the_assistant(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from test_generate_cli import FIXTURES

    from diloco.hf.tokenizer import load_tokenizer

    tok = load_tokenizer(FIXTURES / "tokenizer")  # ChatML, SmolLM2's template
    chats = [[{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": f"A{i}!"}] for i in range(40)]
    pq.write_table(pa.table({"messages": chats}), tmp_path / "c.parquet")
    c = load_corpus(grain_cfg(tmp_path, ["c.parquet"], chat_field="messages", seq_len=256), tok)
    b = train_batch(c.train, seed=0, learner=0, num_learners=1, step=0, batch_size=B, seq_len=256)
    predicted = b["tokens"][:, 1:][b["targets"]]
    text = tok.decode([int(i) for i in predicted], skip_special_tokens=False)
    assert "A" in text and "!" in text and "Q" not in text and "user" not in text  # the assistant's only
    assert (b["segments"].max(axis=1) > 1).all()  # several conversations a row
    c.train.close()


@pytest.mark.slow  # Grain's worker processes start in about 10 s each time
def test_worker_processes_give_a_deterministic_restorable_stream(sets):
    root, _ = sets
    cfg = grain_cfg(root, ["d.parquet"], workers=2)
    a, b = load_corpus(cfg).train, load_corpus(cfg).train
    want = [a.records(learner=0, num_learners=2, step=s) for s in range(6)]
    assert all((x % 2 == 0).all() for x in want)
    state = a.position(0, 2, 4)
    b.restore(0, 2, 4, state)
    assert all((b.records(learner=0, num_learners=2, step=s) == want[s]).all() for s in (4, 5))
    assert min(b._feeds[(0, 2, 0)].made) == 4
    a.close()
    b.close()


@pytest.mark.slow  # 7.5 s here: the S3 client's start-up, three times
def test_a_set_in_an_s3_bucket_is_copied_once_and_read_as_local_files(tmp_path):
    """Through diloco/store's S3 client, against the local S3 server of tests/test_blobstore_s3.py."""
    pytest.importorskip("localbucket")
    from test_blobstore_s3 import BUCKET, LocalS3

    write_sets(tmp_path, n=30)
    s3 = LocalS3(tmp_path / "s3").start()
    try:
        (tmp_path / "s3" / BUCKET / "sets").mkdir(parents=True)
        for name in ("d.parquet", "d.jsonl"):
            (tmp_path / "s3" / BUCKET / "sets" / name).write_bytes((tmp_path / name).read_bytes())
        url = s3.url("sets/*.parquet")
        c = load_corpus(replace(grain_cfg(tmp_path, []), paths=(url,)))
        assert [f.name for f in c.train.recipe.files.files] == ["d.parquet"]
        local = load_corpus(grain_cfg(tmp_path, ["d.parquet"]))
        assert (c.train.records(learner=0, num_learners=1, step=2)
                == local.train.records(learner=0, num_learners=1, step=2)).all()
        before = s3.requests
        load_corpus(replace(grain_cfg(tmp_path, []), paths=(url,)))
        assert s3.requests - before <= 2  # listed again, not fetched again
        with pytest.raises(DataError, match="matches no objects"):
            load_corpus(replace(grain_cfg(tmp_path, []), paths=(s3.url("sets/*.array_record"),)))
        c.train.close()
        local.train.close()
    finally:
        s3.stop()
