"""Wire format: frames round-trip, and every way a frame can be wrong has its own quarantine reason."""

import json
import struct

import numpy as np
import pytest
import zstandard

from diloco.algo import codec_specs, payloads
from diloco.algo import messages as msg
from diloco.algo.codecs import make_codec
from diloco.algo.messages import MessageError

FP32 = make_codec("fp32")
VALUES = {
    ("dense", "kernel"): np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6),
    ("dense", "bias"): np.array([0.5, -0.25, 2.0], np.float32),
}
EXPECTED = {path: (v.shape, np.float32) for path, v in VALUES.items()}


def header(**over):
    h = dict(kind="contribution", learner=1, incarnation=0, seq=7, fragment=2, base_version=3,
             version=3, c_steps=4, c_tokens=4096, codec="fp32", delta_against=None, tensors=[])
    h.update(over)
    return h


def frame_for(values=VALUES, codec=FP32, spec="fp32", **over):
    tensors, payload, _ = payloads.pack_fragment(values, codec, {})
    return msg.encode(header(codec=spec, tensors=tensors, **over), payload)


def reason(frame, **kw):
    with pytest.raises(MessageError) as e:
        msg.decode(frame, **kw)
    return e.value.reason


def reframe(h: dict, payload: bytes) -> bytes:
    """A frame written by hand, bypassing encode's validation."""
    raw = json.dumps(h).encode()
    return struct.pack("<4sI", msg.MAGIC, len(raw)) + raw + payload


def test_round_trip_fills_length_and_checksum():
    frame = frame_for()
    m = msg.decode(frame)
    assert m.header["payload_len"] == len(m.payload) == 4 * (24 + 3)
    assert m.header["checksum"] == msg.checksum(m.payload)
    assert frame[:4] == msg.MAGIC == b"DLC2"
    assert [t["path"] for t in m.header["tensors"]] == [["dense", "bias"], ["dense", "kernel"]]
    out = payloads.unpack_fragment(m.header, m.payload, FP32, EXPECTED)
    for path, v in VALUES.items():
        np.testing.assert_array_equal(out[path], v)  # fp32 is exact
        assert out[path].dtype == np.float32


def test_int4_round_trip_within_half_a_step():
    codec = make_codec("int4", error_feedback=True, zstd_level=1)
    spec = codec_specs.codec_spec("int4", True, 1)
    assert spec == "int4+ef+zstd1"
    m = msg.decode(frame_for(codec=codec, spec=spec))
    # The receiver decodes without error feedback: same wire format.
    out = payloads.unpack_fragment(m.header, m.payload, make_codec("int4", zstd_level=1), EXPECTED)
    for path, v in VALUES.items():
        step = np.abs(v).max() / 7  # one block per tensor here
        assert np.abs(out[path] - v).max() <= step / 2 * (1 + 1e-6)


def test_pack_threads_error_feedback_state():
    codec = make_codec("2bit", error_feedback=True)
    _, _, states = payloads.pack_fragment(VALUES, codec, None)
    assert set(states) == set(VALUES)
    assert np.abs(states[("dense", "kernel")].residual).max() > 0  # the quantization error is kept


def test_corrupt_frames_have_their_own_reason():
    frame = frame_for()
    flipped = bytearray(frame)
    flipped[-1] ^= 0x01
    assert reason(bytes(flipped)) == "checksum"
    assert reason(frame[:-5]) == "truncated"
    assert reason(frame[:6]) == "truncated"
    assert reason(frame + b"\0") == "trailing_bytes"
    assert reason(b"DLC1" + frame[4:]) == "bad_magic"  # the previous version (tests/test_checksum.py)
    assert reason(b"GIF8" + frame[4:]) == "bad_magic"
    assert reason(frame, max_payload=4 * 27 - 1) == "too_large"
    assert msg.decode(frame, max_payload=4 * 27).header["seq"] == 7
    not_json = struct.pack("<4sI", msg.MAGIC, 5) + b"{oops"
    assert reason(not_json) == "bad_header"


def test_header_fields_are_validated():
    m = msg.decode(frame_for())
    h, p = m.header, m.payload

    def bad(**over):
        return reason(reframe({**h, **over}, p))

    missing = dict(h)
    del missing["base_version"]
    assert reason(reframe(missing, p)) == "bad_header"
    assert bad(c_steps=-1) == "bad_header"
    assert bad(c_tokens=3) == "bad_header"  # fewer tokens than steps
    assert bad(seq="7") == "bad_header"
    assert bad(learner=True) == "bad_header"  # JSON true is not an int
    assert bad(kind="gossip") == "bad_header"
    assert bad(delta_against=-1) == "bad_header"
    assert bad(extra=1) == "bad_header"
    assert bad(payload_len=len(p) + 1) == "bad_header"  # disagrees with the tensors' nbytes
    assert bad(tensors=[{"path": [], "shape": [3], "dtype": "float32", "nbytes": len(p)}]) == "bad_header"
    with pytest.raises(MessageError, match="bad_header"):  # encode refuses to send a bad header
        msg.encode(header(c_steps=-1), b"")
    assert b"NaN" in reframe({**h, "c_steps": float("nan")}, p)  # Python's JSON extension, not JSON
    assert bad(c_steps=float("nan")) == "bad_header"


def test_shape_and_dtype_mismatches():
    m = msg.decode(frame_for())
    with pytest.raises(MessageError, match="wrong_shape"):
        payloads.unpack_fragment(m.header, m.payload, FP32, {**EXPECTED, ("dense", "bias"): ((4,), np.float32)})
    with pytest.raises(MessageError, match="wrong_shape"):
        payloads.unpack_fragment(m.header, m.payload, FP32, {("dense", "kernel"): ((4, 6), np.float32)})
    with pytest.raises(MessageError, match="wrong_dtype"):
        payloads.unpack_fragment(m.header, m.payload, FP32, {**EXPECTED, ("dense", "bias"): ((3,), np.float16)})
    h = {**m.header, "tensors": [dict(t, dtype="bfloat16") for t in m.header["tensors"]]}
    with pytest.raises(MessageError, match="wrong_dtype"):
        payloads.unpack_fragment(h, m.payload, FP32, EXPECTED)
    with pytest.raises(MessageError, match="wrong_codec"):
        payloads.unpack_fragment(m.header, m.payload, make_codec("int4"), EXPECTED)


def test_nan_payload_is_non_finite():
    bad = np.array([1.0, np.nan, 3.0], "<f4").tobytes()
    t = [{"path": ["w"], "shape": [3], "dtype": "float32", "nbytes": len(bad)}]
    m = msg.decode(msg.encode(header(tensors=t), bad))  # the frame itself is sound
    with pytest.raises(MessageError) as e:
        payloads.unpack_fragment(m.header, m.payload, FP32, {("w",): ((3,), np.float32)})
    assert e.value.reason == "non_finite"


def test_truncated_zstd_inside_a_valid_frame_is_codec_error():
    x = np.linspace(0, 1, 256, dtype=np.float32)
    good = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(x.tobytes())
    cut = good[:-7]
    t = [{"path": ["w"], "shape": [256], "dtype": "float32", "nbytes": len(cut)}]
    m = msg.decode(msg.encode(header(codec="fp32+zstd1", tensors=t), cut))
    with pytest.raises(MessageError) as e:
        payloads.unpack_fragment(m.header, m.payload, None, {("w",): ((256,), np.float32)})
    assert e.value.reason == "codec_error"


def test_codec_specs():
    for name, ef, level in [("fp32", False, 0), ("int4", True, 1), ("topk", True, 3), ("2bit", True, 0)]:
        spec = codec_specs.codec_spec(name, ef, level)
        assert codec_specs.codec_from_spec(spec).name == make_codec(name, error_feedback=ef, zstd_level=level).name
    assert codec_specs.codec_spec("int8", block=32) == "int8+b32"
    assert codec_specs.codec_from_spec("int8+b32").name == "int8(block=32)"
    assert codec_specs.codec_from_spec("topk+k0.05").name == "topk(fraction=0.05)"
    for bad in ["int3", "int4+zstd", "int4+zstd1+ef", "", "int4+ef+ef"]:
        with pytest.raises(MessageError, match="wrong_codec"):
            codec_specs.codec_from_spec(bad)


def test_payload_bound_holds_for_real_payloads():
    rng = np.random.default_rng(0)
    values = {("a",): rng.standard_normal((130,)), ("b",): rng.standard_normal((8, 8))}  # float64 in, fp32 on the wire
    shapes = [v.shape for v in values.values()]
    for spec in ["fp32", "int4", "int4+ef+zstd1", "topk+ef", "fp32+zstd3"]:
        _, payload, _ = payloads.pack_fragment(values, codec_specs.codec_from_spec(spec), None)
        assert len(payload) <= codec_specs.payload_bound(spec, shapes), spec
    assert codec_specs.payload_bound("int4", shapes) == 4 * 3 + 65 + 4 * 1 + 32  # scales + packed nibbles


def test_admission_reasons():
    known = {1: 2, 3: 0}  # learner -> live incarnation
    last = {(1, 2): 10}

    def admit(max_staleness=None, **over):
        h = header(**{**dict(learner=1, incarnation=2, seq=11, base_version=5), **over})
        return msg.check_admission(h, known, last, 8, max_staleness, num_fragments=4)

    assert admit() is None
    assert admit(max_staleness=3) is None  # staleness 8 - 5 = 3 is allowed
    assert admit(max_staleness=2) == "stale"
    assert admit(learner=9) == "unknown_learner"
    assert admit(incarnation=1) == "dead_incarnation"
    assert admit(incarnation=3) == "unknown_incarnation"  # a restart is the runtime's to report
    assert admit(seq=10) == "duplicate"
    assert admit(seq=3) == "duplicate"
    assert admit(base_version=9) == "future_version"
    assert admit(fragment=4) == "unknown_fragment"
    assert admit(kind="ack") == "wrong_kind"
    assert msg.check_admission(header(learner=3, incarnation=0, seq=0, base_version=0), known, last, 0, 0) is None


def test_reasons_are_listed_once():
    assert len(set(msg.QUARANTINE_REASONS)) == len(msg.QUARANTINE_REASONS)
    with pytest.raises(AssertionError):
        MessageError("made_up")
