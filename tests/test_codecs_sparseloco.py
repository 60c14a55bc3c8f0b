"""codec=sparseloco (diloco/algo/sparseloco.py, docs/algorithm.md#sparseloco): chunked top-k with
2-bit sign codes computed by hand, its bytes per kept value, decayed error feedback, every hostile
payload refused as a CodecError, its spec grammar, config checks and the bandwidth model's bytes."""

import numpy as np
import pytest

from diloco import bandwidth as A
from diloco.algo import codec_specs, messages
from diloco.algo.codecs import CodecError, error_feedback, make_codec
from diloco.algo.sparseloco import bits_per_kept_value, sparseloco
from test_sim import build, corpus, model  # noqa: F401  (fixtures)


def test_two_chunks_by_hand():
    """chunk 8, k 2: the first chunk keeps -3 and 2 (indices 1, 3) under scale 2.5 = mean |kept|, the
    short last chunk of 4 keeps 1 and a zero, which stays exactly 0 (code 0)."""
    c = sparseloco(chunk=8, k=2)
    x = np.array([0.1, -3.0, 0.2, 2.0, 0.0, 0.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.0], np.float32)
    payload, _ = c.encode(x, ())
    # 2 scales, 4 indices of 3 bits (2 bytes), 4 codes of 2 bits (1 byte)
    assert len(payload) == c.payload_bytes(x.shape) == 8 + 2 + 1
    np.testing.assert_array_equal(np.frombuffer(payload[:8], "<f4"), [2.5, 1.0])
    assert payload[8] == 0b00_011_001  # indices 1, 3, then 0 (the tail's 1.0), 3 bits each, low bits first
    assert payload[10] == 0b00_01_01_10  # codes: -3 -> 2 (-scale), 2 -> 1, 1.0 -> 1, the kept zero -> 0
    np.testing.assert_array_equal(c.decode(payload, x.shape),
                                  [0, -2.5, 0, 2.5, 0, 0, 0, 0, 1.0, 0, 0, 0])


def test_keeps_the_k_largest_of_every_chunk():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 100)).astype(np.float32)  # 500 values: 7 chunks of 64 and one of 52
    c = sparseloco(chunk=64, k=5)
    y = c.decode(c.encode(x, ())[0], x.shape).reshape(-1)
    flat = x.reshape(-1)
    for lo in range(0, 500, 64):
        kept = np.flatnonzero(y[lo:lo + 64])
        np.testing.assert_array_equal(np.sort(kept), np.sort(np.argsort(-np.abs(flat[lo:lo + 64]))[:5]))
        np.testing.assert_array_equal(np.sign(y[lo:lo + 64][kept]), np.sign(flat[lo:lo + 64][kept]))
        np.testing.assert_allclose(np.abs(y[lo:lo + 64][kept]), np.abs(flat[lo:lo + 64][kept]).mean(), rtol=1e-6)


def test_bits_per_kept_value():
    """12-bit index + 2-bit code = 14, plus the chunk's float32 scale over its 32 kept values."""
    assert bits_per_kept_value() == 12 + 2 + 32 / 32
    assert bits_per_kept_value(1024, 16) == 10 + 2 + 2
    assert A.wire_bits("sparseloco") == pytest.approx(15 * 32 / 4096)  # 0.117 bits a parameter
    assert A.payload_bytes("sparseloco", 10_000) == make_codec("sparseloco").payload_bytes((10_000,)) \
        == 3 * 4 + -(-(2 * 32 + 32) * 12 // 8) + -(-(2 * 32 + 32) * 2 // 8)
    int4 = A.diloco_bytes_per_step(820_352, 24, 24, up="int4")
    sparse = A.diloco_bytes_per_step(820_352, 24, 24, up="sparseloco")
    assert 35 < int4.up / sparse.up < 40 and sparse.down == int4.down


def test_decayed_error_feedback_by_hand():
    """encode(x, r) sends C(x + d r) and keeps (x + d r) - decode; d = 1 is plain error feedback."""
    rng = np.random.default_rng(0)
    x, r = rng.standard_normal(300).astype(np.float32), rng.standard_normal(300).astype(np.float32)
    base = sparseloco(chunk=64, k=4)
    ef = error_feedback(base, decay=0.5)
    state = ef.init(x.shape)._replace(residual=r)
    payload, state = ef.encode(x, state)
    target = x + np.float32(0.5) * r
    assert payload == base.encode(target, ())[0]
    np.testing.assert_array_equal(state.residual, target - base.decode(payload, x.shape))
    plain, decayed_1 = error_feedback(base), error_feedback(base, decay=1.0)
    s0 = plain.init(x.shape)._replace(residual=r)
    assert plain.encode(x, s0)[0] == decayed_1.encode(x, s0)[0]
    with pytest.raises(ValueError, match="decay must be in"):
        error_feedback(base, decay=0.0)


def _payload(scales, indices, codes, bits):
    from diloco.algo.sparseloco import _pack
    return (np.asarray(scales, "<f4").tobytes() + _pack(np.asarray(indices), bits) + _pack(np.asarray(codes), 2))


@pytest.mark.parametrize("bad, why", [
    (lambda: _payload([1.0, 1.0], [3, 1, 0, 1], [1, 1, 1, 1], 3), "strictly increasing"),  # decreasing
    (lambda: _payload([1.0, 1.0], [1, 1, 0, 1], [1, 1, 1, 1], 3), "strictly increasing"),  # repeated
    (lambda: _payload([1.0, 1.0], [1, 3, 0, 4], [1, 1, 1, 1], 3), "strictly increasing and < 4"),  # past the tail
    (lambda: _payload([1.0, 1.0], [1, 3, 0, 1], [1, 3, 1, 1], 3), "code 3"),
    (lambda: _payload([-1.0, 1.0], [1, 3, 0, 1], [1, 1, 1, 1], 3), "scales"),
    (lambda: _payload([np.nan, 1.0], [1, 3, 0, 1], [1, 1, 1, 1], 3), "scales"),
    (lambda: _payload([1.0, 1.0], [1, 3, 0, 1], [1, 1, 1, 1], 3)[:-1], "payload is 10 bytes"),
    (lambda: _payload([1.0, 1.0], [1, 3, 0, 1], [1, 1, 1, 1], 3) + b"\0", "payload is 12 bytes"),
    (lambda: _payload([1.0, 1.0], [1, 3, 0, 1], [1, 1, 1, 1], 3)[:9] + b"\x80" + bytes([0b01010101]), "padding"),
])
def test_hostile_payloads_are_codec_errors(bad, why):
    """chunk 8, k 2, 12 values: two chunks (8 and 4), 4 kept; a valid payload decodes."""
    c = sparseloco(chunk=8, k=2)
    assert c.decode(_payload([1.0, 1.0], [1, 3, 0, 1], [1, 2, 0, 1], 3), (12,))[[1, 3, 9]].tolist() == [1, -1, 1]
    with pytest.raises(CodecError, match=why):
        c.decode(bad(), (12,))


def test_spec_grammar_and_refusals():
    assert codec_specs.codec_spec("sparseloco", True, 0, chunk=1024, chunk_k=16) == "sparseloco+ef+c1024+t16"
    assert codec_specs.codec_from_spec("sparseloco+c1024+t16").payload_bytes((1024,)) == 4 + 16 * 10 // 8 + 4
    for spec in ["sparseloco+c1000", "sparseloco+t0", "sparseloco+c64+t65", "sparseloco+c131072",
                 "sparseloco+c4096", "sparseloco+t" + "9" * 13]:
        with pytest.raises(messages.MessageError, match="wrong_codec"):
            codec_specs.codec_from_spec(spec)
    assert codec_specs.payload_bound("sparseloco+ef", [(5000,), (3,)]) == \
        make_codec("sparseloco").payload_bytes((5000,)) + make_codec("sparseloco").payload_bytes((3,))


def test_config_checks_name_the_values(tmp_path):
    from conftest import tiny_cfg

    from diloco.config import ConfigError
    with pytest.raises(ConfigError, match=r"codec.ef_decay=0.9 needs codec.error_feedback=true and a host-encoded "
                                          r"up codec \(sparseloco or topk\), not codec.up='int4'"):
        tiny_cfg(tmp_path, codec=dict(ef_decay=0.9, error_feedback=True))
    with pytest.raises(ConfigError, match="codec.chunk=1000 must be a power of two"):
        tiny_cfg(tmp_path, codec=dict(up="sparseloco", chunk=1000))
    with pytest.raises(ConfigError, match=r"codec.chunk_k=99 must be in \[1, codec.chunk=64\]"):
        tiny_cfg(tmp_path, codec=dict(up="sparseloco", chunk=64, chunk_k=99))
    cfg = tiny_cfg(tmp_path, codec=dict(up="sparseloco", error_feedback=True, ef_decay=0.95, zstd_level=0))
    from diloco.runtime.build import run_codecs
    wire = run_codecs(cfg)
    assert wire.up_spec == "sparseloco+ef" and wire.up.name == "error_feedback(sparseloco(chunk=4096,k=32))"


@pytest.mark.slow  # 28 s here under load (compiling the learners' steps)
def test_a_sim_run_sends_sparseloco_and_merges(tmp_path, build):
    """End to end on sim: learners encode with decayed error feedback on the host, the syncer decodes
    by the header's spec, every contribution merges and the ledger balances."""
    from test_sim import make_cfg

    from diloco.runtime import sim
    cfg = make_cfg(tmp_path, steps=8, codec=dict(up="sparseloco", error_feedback=True, ef_decay=0.95,
                                                 chunk=64, chunk_k=8, zstd_level=0))
    rt, summary = sim.run(cfg, build(cfg), tmp_path / "run", None)
    assert summary["merges"] == 4 and summary["quarantined"] == 0 and summary["token_ledger_imbalance"] == 0
    assert rt.units[0].spec.up_spec == "sparseloco+ef+c64+t8"
    residuals = [s.residual for s in rt.units[0].codec_states.values()]
    assert residuals and any(np.abs(r).sum() > 0 for r in residuals)  # the unsent 7/8 wait there
