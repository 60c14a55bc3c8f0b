"""The frame checksum (diloco/algo/checksum.py): its definition restated here from
docs/design.md#messages, the same digest on any number of threads, every flipped byte, truncation
and extension caught, and frames of the previous version (DLC1) refused by name."""

import hashlib
import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.algo import checksum as ck
from diloco.algo import hostpool, messages

PIECE = ck.PIECE


def reference(payload: bytes, piece: int = PIECE) -> str:
    """The tree digest as docs/design.md#messages states it, one piece at a time on one thread."""
    leaves = b"".join(hashlib.blake2b(payload[lo:lo + piece], digest_size=16, person=b"diloco/piece").digest()
                      for lo in range(0, len(payload), piece))
    root = struct.pack("<QQ", len(payload), piece) + leaves
    return hashlib.blake2b(root, digest_size=8, person=b"diloco/root").hexdigest()


def patterned(n: int) -> bytes:
    return (np.arange(n, dtype=np.int64) % 251).astype(np.uint8).tobytes()


def on_threads(n: int, payload, monkeypatch) -> str:
    with monkeypatch.context() as m:
        m.setattr(hostpool, "threads", lambda: n)
        return ck.checksum(payload)


# Pinned so that a change to the digest is a decision, not an accident: every frame of a build with
# another digest is refused as `checksum` by this one. To change it on purpose, bump messages.MAGIC
# (a new frame version), update docs/design.md#messages, then paste the new values here.
GOLDEN = {0: "5aa827ef90ffeb5e", 3: "08b4a6a408891106", (5 << 19) + 3: "8495d194bf227406"}


def test_golden_digests_and_the_stated_definition():
    assert ck.checksum(b"") == GOLDEN[0] == reference(b"")
    assert ck.checksum(b"abc") == GOLDEN[3] == reference(b"abc")  # one short piece
    big = patterned((5 << 19) + 3)  # two whole pieces and a short one
    assert ck.checksum(big) == GOLDEN[len(big)] == reference(big)
    assert len(ck.checksum(big)) == 2 * ck.DIGEST_BYTES == 16


def test_any_buffer_of_the_same_bytes_has_the_same_digest():
    data = patterned(PIECE + 17)
    want = ck.checksum(data)
    assert ck.checksum(bytearray(data)) == ck.checksum(memoryview(data)) == want
    assert ck.checksum(np.frombuffer(data, np.uint8)) == want
    words = np.frombuffer(data[:PIECE + 16], np.float32).reshape(-1, 4)  # 2-D, 4-byte items
    assert ck.checksum(words) == ck.checksum(data[:PIECE + 16])  # read as its bytes


# Sizes around the piece boundaries: empty, a byte, one piece less or more a byte, up to three.
SIZES = st.one_of(st.integers(0, 3), st.builds(lambda k, d: max(0, k * PIECE + d), st.integers(1, 3),
                                               st.integers(-2, 2)))


@settings(max_examples=25, deadline=None)
@given(n=SIZES, seed=st.integers(0, 2**32 - 1))
def test_the_digest_never_depends_on_the_thread_count(n, seed):
    payload = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    with pytest.MonkeyPatch.context() as m:
        digests = [on_threads(t, payload, m) for t in (1, 2, 5)]
    assert digests == [reference(payload)] * 3


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), piece=st.sampled_from([1, 7, 64]), threads=st.sampled_from([1, 2]))
def test_small_pieces_match_the_definition_on_any_thread_count(data, piece, threads):
    """The same code at a tiny piece size: many pieces per payload, every boundary exercised."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ck, "PIECE", piece)
        assert on_threads(threads, data, m) == reference(data, piece)


def test_every_flipped_byte_is_caught_first_and_last_of_each_piece_included(monkeypatch):
    monkeypatch.setattr(hostpool, "threads", lambda: 2)
    payload = bytearray(patterned(2 * PIECE + 5))
    good = ck.checksum(payload)
    edges = [0, 1, PIECE - 1, PIECE, PIECE + 1, 2 * PIECE - 1, 2 * PIECE, len(payload) - 1]
    rng = np.random.default_rng(0)
    for pos in edges + rng.integers(0, len(payload), 8).tolist():
        for mask in (0x01, 0x80, 0xFF):
            payload[pos] ^= mask
            assert ck.checksum(payload) != good, (pos, mask)
            payload[pos] ^= mask
    assert ck.checksum(payload) == good


@settings(max_examples=300, deadline=None)
@given(data=st.binary(min_size=1, max_size=200), where=st.integers(0), mask=st.integers(1, 255),
       piece=st.sampled_from([1, 16, 64]))
def test_a_flipped_byte_anywhere_is_caught_at_small_pieces(data, where, mask, piece):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(ck, "PIECE", piece)
        flipped = bytearray(data)
        flipped[where % len(data)] ^= mask
        assert ck.checksum(bytes(flipped)) != ck.checksum(data)


def test_truncation_and_extension_are_caught(monkeypatch):
    monkeypatch.setattr(hostpool, "threads", lambda: 2)
    payload = patterned(2 * PIECE)  # ends on a piece boundary
    good = ck.checksum(payload)
    for other in (payload[:-1], payload[:PIECE], payload[1:], payload + b"\0", payload + bytes(PIECE),
                  payload + payload[:PIECE], b""):
        assert ck.checksum(other) != good, len(other)
    # Zeros only: a payload and a longer one hash to different roots even where every piece's
    # bytes look alike (the length prefix, not the piece digests, tells them apart).
    assert len({ck.checksum(bytes(n)) for n in (0, 1, PIECE, PIECE + 1, 2 * PIECE)}) == 5


def test_a_piece_digest_list_is_not_a_payload_of_the_same_root():
    """The root input of a payload is never the leaf input of another: the personalisations
    separate them (a second-preimage across tree levels)."""
    payload = patterned(PIECE + 1)
    leaves = b"".join(hashlib.blake2b(payload[lo:lo + PIECE], digest_size=16, person=b"diloco/piece").digest()
                      for lo in (0, PIECE))
    root_input = struct.pack("<QQ", len(payload), PIECE) + leaves
    assert ck.checksum(root_input) != ck.checksum(payload)


# --- frames ------------------------------------------------------------------------------------
def header(nbytes: int) -> dict:
    return dict(kind="contribution", learner=0, incarnation=0, seq=1, fragment=0, base_version=0,
                version=0, c_steps=1, c_tokens=8, codec="fp32", delta_against=None,
                tensors=[{"path": ["w"], "shape": [nbytes // 4], "dtype": "float32", "nbytes": nbytes}])


def reason_and_detail(frame: bytes) -> tuple[str, str]:
    with pytest.raises(messages.MessageError) as e:
        messages.decode(frame)
    return e.value.reason, e.value.detail


def test_a_frame_of_several_pieces_round_trips_and_a_flip_in_any_piece_is_quarantined():
    payload = patterned(4 * (PIECE // 2 + 3))  # two pieces and 12 bytes: three pieces
    frame = messages.encode(header(len(payload)), payload)
    assert frame[:4] == messages.MAGIC == b"DLC2"
    m = messages.decode(frame)
    assert m.payload == payload and m.header["checksum"] == ck.checksum(payload) == reference(payload)
    for back in (1, len(payload) - PIECE, len(payload) - 2 * PIECE + 1, len(payload)):
        bad = bytearray(frame)
        bad[-back] ^= 0x10
        assert reason_and_detail(bytes(bad))[0] == "checksum", back


def test_a_dlc1_frame_is_refused_by_version_name():
    """A frame of the previous build: DLC1 magic and one blake2b stream as its checksum."""
    payload = patterned(64)
    h = dict(header(64), payload_len=64, checksum=hashlib.blake2b(payload, digest_size=8).hexdigest())
    raw = json.dumps(h, separators=(",", ":")).encode()
    old = struct.pack("<4sI", b"DLC1", len(raw)) + raw + payload
    reason, detail = reason_and_detail(old)
    assert reason == "bad_magic" and detail == "frame version DLC1, this build speaks DLC2"
    assert reason_and_detail(b"DLC9" + old[4:]) == ("bad_magic", "frame version DLC9, this build speaks DLC2")
    assert reason_and_detail(b"XLC2" + old[4:])[0] == "bad_magic"
    # the same frame under this build's magic still fails: its checksum is the old stream's
    assert reason_and_detail(messages.MAGIC + old[4:])[0] == "checksum"
