"""The wire format between learners and the syncer: a JSON header plus raw payload bytes (docs/design.md#messages).

Reference: Decoupled DiLoCo (Douillard et al., arXiv 2604.21428); docs/algorithm.md#admission-and-quarantine.

A frame is `b"DLC2" | uint32 LE header length | UTF-8 JSON header | payload`. Nothing is pickled:
a frame from a crashed, buggy or hostile peer can at worst be rejected, never execute code. Every
rejection is a `MessageError` whose `reason` is one of QUARANTINE_REASONS, so the syncer can
quarantine the message and book its tokens under that reason in the ledger.

This module holds the frame (encode, decode, the header's validation, the payload's checksum), the
quarantine reasons and the syncer's admission rule (check_admission). A fragment's payload is
packed and unpacked in diloco/algo/payloads.py; the header's codec string is read in
diloco/algo/codec_specs.py.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any, NamedTuple

from diloco.algo import auth
from diloco.algo.bounds import loads_json
from diloco.algo.checksum import checksum

Path = tuple[str, ...]

# The frame version: DLC2 frames carry the tree checksum (diloco/algo/checksum.py), DLC1 frames
# carried one blake2b stream over the payload. A frame of another version is refused (bad_magic).
MAGIC = b"DLC2"
_FAMILY = b"DLC"
_PREFIX = struct.Struct("<4sI")  # magic, header length
MAX_HEADER_BYTES = 1 << 20  # a header lists tensor shapes only; 1 MiB is thousands of tensors
# A header nests 4 deep (header, tensors, one tensor, its path); json.loads recurses once per level
# and raises RecursionError near 1,000, so nesting is bounded before it parses.
MAX_HEADER_DEPTH = 16
# Every int a header holds is below 2**53: exact as a float64, so a counter's square (the token
# weight) and a norm divided by it stay finite; 2**53 steps or tokens is far beyond any run.
MAX_COUNT = 1 << 53
KINDS = ("contribution", "fragment", "ack")

# Frame and header faults (decode), payload faults (payloads.unpack_fragment), admission faults
# (check_admission).
FRAME_REASONS = ("bad_magic", "bad_header", "truncated", "trailing_bytes", "too_large", "checksum",
                 "bad_counter",
                 "unauthenticated")  # its tag does not verify: nothing in the header can be believed
PAYLOAD_REASONS = ("wrong_codec", "wrong_shape", "wrong_dtype", "codec_error", "non_finite")
ADMISSION_REASONS = (
    "wrong_kind", "unknown_learner", "unknown_fragment", "dead_incarnation",
    "unknown_incarnation",  # newer than the live one: incarnations come from the runtime, never a frame
    "duplicate",
    "future_version", "stale", "exploding_norm",
    "overflow",  # admitted, but merging it would make Theta non-finite: dropped from the merge
)
QUARANTINE_REASONS = FRAME_REASONS + PAYLOAD_REASONS + ADMISSION_REASONS

# Field -> accepted JSON types. bool is excluded from int explicitly (JSON true is a Python int).
_INT_FIELDS = ("learner", "incarnation", "seq", "fragment", "base_version", "version", "c_steps",
               "c_tokens", "payload_len")
HEADER_FIELDS = ("kind", *_INT_FIELDS, "codec", "delta_against", "tensors", "checksum")
# A broadcast (kind "fragment") may list the contributions its merge took in, as [learner,
# incarnation, seq]: a learner applies a merge at its tau step only if it answers its own send.
# A contribution of a run that authenticates learners carries an HMAC tag (diloco/algo/auth.py).
OPTIONAL_FIELDS = ("merged", auth.MAC_FIELD)


class MessageError(ValueError):
    """A message that must be quarantined; `reason` is one of QUARANTINE_REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        assert reason in QUARANTINE_REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class Message(NamedTuple):
    header: dict[str, Any]  # validated; tensor paths are lists of str as on the wire
    payload: bytes | memoryview  # decode gives a view into the frame


def _is_int(x: Any) -> bool:
    return type(x) is int


def _is_count(x: Any) -> bool:
    """A non-negative JSON int below MAX_COUNT (bool excluded: JSON true is a Python int)."""
    return type(x) is int and 0 <= x < MAX_COUNT


def _bad(detail: str) -> MessageError:
    return MessageError("bad_header", detail)


def _check_tensors(tensors: Any) -> None:
    if not isinstance(tensors, list):
        raise _bad(f"tensors must be a list, got {type(tensors).__name__}")
    seen: set[Path] = set()
    for i, t in enumerate(tensors):
        if not isinstance(t, dict) or set(t) != {"path", "shape", "dtype", "nbytes"}:
            raise _bad(f"tensors[{i}] must have exactly path, shape, dtype, nbytes; got {t!r}")
        path, shape = t["path"], t["shape"]
        if not isinstance(path, list) or not path or not all(isinstance(k, str) for k in path):
            raise _bad(f"tensors[{i}].path must be a non-empty list of str, got {path!r}")
        if tuple(path) in seen:
            raise _bad(f"tensors[{i}].path {path!r} appears twice")
        seen.add(tuple(path))
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise _bad(f"tensors[{i}].shape must be a list of non-negative int, got {shape!r}")
        if not isinstance(t["dtype"], str):
            raise _bad(f"tensors[{i}].dtype must be str, got {t['dtype']!r}")
        if not _is_count(t["nbytes"]):
            raise _bad(f"tensors[{i}].nbytes must be a non-negative int, got {t['nbytes']!r}")


def _check_merged(header: dict) -> None:
    merged = header.get("merged", [])
    if merged and header["kind"] != "fragment":
        raise _bad(f"only a fragment broadcast lists merged contributions, got kind {header['kind']!r}")
    if not isinstance(merged, list) or not all(
            isinstance(k, list) and len(k) == 3 and all(_is_count(x) for x in k) for k in merged):
        raise _bad(f"merged must be a list of [learner, incarnation, seq] non-negative ints, got {merged!r}")


def merged_keys(header: dict) -> frozenset[tuple[int, int, int]]:
    """The (learner, incarnation, seq) of every contribution a broadcast's merge took in."""
    return frozenset(tuple(k) for k in header.get("merged", []))


def validate_header(header: Any) -> None:
    """Raise MessageError("bad_header") unless every field is present, typed and consistent."""
    if not isinstance(header, dict):
        raise _bad(f"header must be a JSON object, got {type(header).__name__}")
    missing = [f for f in HEADER_FIELDS if f not in header]
    extra = sorted(set(header) - set(HEADER_FIELDS) - set(OPTIONAL_FIELDS))
    if missing or extra:
        raise _bad(f"missing fields {missing}, unknown fields {extra}")
    if header["kind"] not in KINDS:
        raise _bad(f"kind must be one of {KINDS}, got {header['kind']!r}")
    for f in _INT_FIELDS:
        if not _is_int(header[f]) or header[f] < 0:
            raise _bad(f"{f} must be a non-negative int, got {str(header[f])[:40]!r}")
        if header[f] >= MAX_COUNT:
            raise MessageError("bad_counter", f"{f} = {str(header[f])[:40]}... >= 2**53")
    c_steps, c_tokens = header["c_steps"], header["c_tokens"]
    # Every inner step consumes at least one token, and tokens come only from steps.
    if c_tokens < c_steps or (c_steps == 0) != (c_tokens == 0):
        raise _bad(f"c_tokens={c_tokens} inconsistent with c_steps={c_steps}")
    if not isinstance(header["codec"], str) or not header["codec"]:
        raise _bad(f"codec must be a non-empty str, got {header['codec']!r}")
    d = header["delta_against"]
    if d is not None and not _is_count(d):
        raise _bad(f"delta_against must be null or a non-negative int, got {d!r}")
    if header["kind"] == "fragment" and d is not None and d >= header["version"]:
        raise _bad(f"a delta against version {d} cannot publish version {header['version']}")
    if not isinstance(header["checksum"], str):
        raise _bad(f"checksum must be str, got {header['checksum']!r}")
    if not isinstance(header.get(auth.MAC_FIELD, ""), str):
        raise _bad(f"mac must be str, got {str(header[auth.MAC_FIELD])[:40]!r}")
    _check_tensors(header["tensors"])
    _check_merged(header)
    total = sum(t["nbytes"] for t in header["tensors"])
    if total != header["payload_len"]:
        raise _bad(f"tensors' nbytes sum to {total}, payload_len is {header['payload_len']}")


def encode(header: Mapping[str, Any], payload: bytes, key: bytes | None = None) -> bytes:
    """One frame; fills payload_len and checksum, and validates the header so bad frames never leave.
    `key`: the sending learner's authentication key; the frame then carries its tag."""
    full = dict(header, payload_len=len(payload), checksum=checksum(payload))
    validate_header(full)
    if key is not None:
        full[auth.MAC_FIELD] = auth.tag(key, full, bytes(payload))
    raw = json.dumps(full, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return _PREFIX.pack(MAGIC, len(raw)) + raw + bytes(payload)


def decode(frame: bytes, *, max_payload: int | None = None, verify: bool = True) -> Message:
    """Parse and validate a frame; `max_payload` bounds payload_len before any payload byte is touched.
    verify=False leaves the payload's checksum to payload_fault (a caller checking it concurrently)."""
    frame = bytes(frame)
    if len(frame) < _PREFIX.size:
        if MAGIC.startswith(frame[:4]):
            raise MessageError("truncated", f"{len(frame)} bytes, the prefix alone is {_PREFIX.size}")
        raise MessageError("bad_magic", f"got {frame[:4]!r}")
    magic, hlen = _PREFIX.unpack_from(frame)
    if magic != MAGIC:
        if magic.startswith(_FAMILY):  # a peer of another build: say which, so the fix is plain
            raise MessageError("bad_magic", f"frame version {magic.decode('ascii', 'replace')}, "
                                            f"this build speaks {MAGIC.decode('ascii')}")
        raise MessageError("bad_magic", f"got {magic!r}, want {MAGIC!r}")
    if hlen > MAX_HEADER_BYTES:
        raise MessageError("too_large", f"header of {hlen} bytes > {MAX_HEADER_BYTES}")
    end = _PREFIX.size + hlen
    if len(frame) < end:
        raise MessageError("truncated", f"header declares {hlen} bytes, frame holds {len(frame) - _PREFIX.size}")
    try:
        header = loads_json(frame[_PREFIX.size:end], MAX_HEADER_DEPTH, parse_constant=_no_constant)
    except ValueError as e:
        raise MessageError("bad_header", f"not UTF-8 JSON: {e}") from None
    validate_header(header)
    n = header["payload_len"]
    if max_payload is not None and n > max_payload:
        raise MessageError("too_large", f"payload_len {n} > bound {max_payload}")
    # A view, not a copy: a fragment's full copy is Theta's size, and each tensor's decode reads
    # its own slice of it (payloads.unpack_fragment), so copies here would double the peak.
    payload = memoryview(frame)[end:]
    if len(payload) < n:
        raise MessageError("truncated", f"payload_len {n}, frame holds {len(payload)}")
    if len(payload) > n:
        raise MessageError("trailing_bytes", f"payload_len {n}, frame holds {len(payload)}")
    msg = Message(header, payload)
    fault = payload_fault(msg) if verify else None
    if fault is not None:
        raise fault
    return msg


def payload_fault(msg: Message) -> MessageError | None:
    """The checksum error of a decoded frame's payload, or None if it hashes to its header's."""
    got = checksum(msg.payload)
    if got != msg.header["checksum"]:
        return MessageError("checksum", f"header says {msg.header['checksum']}, payload hashes to {got}")
    return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN / Infinity are Python extensions, not JSON


def check_admission(
    header: Mapping[str, Any],
    known_learners: Mapping[int, int],
    last_seq: Mapping[tuple[int, int], int],
    current_version: int,
    max_staleness: int | None,
    *,
    num_fragments: int | None = None,
    max_steps: int | None = None,
    step_tokens: int | None = None,
) -> str | None:
    """Why the syncer must not admit a validated contribution, or None to admit it.

    `known_learners` maps learner -> live incarnation, `last_seq` (learner, incarnation) -> highest
    seq admitted, `current_version` is the syncer's version of the header's fragment. Only the live
    incarnation is admitted: an older one is dead, and a newer one is refused until the runtime
    reports the restart (docs/algorithm.md#failures-and-rejoin), so a frame cannot kill a learner.
    `max_steps` bounds c_steps and `step_tokens` the tokens of one step (c_tokens <= c_steps x
    step_tokens): the counters weigh the merge, so a frame may claim no more than a learner can do
    (docs/algorithm.md#bounds-on-what-a-frame-can-claim).
    """
    if header["kind"] != "contribution":
        return "wrong_kind"
    m, inc = header["learner"], header["incarnation"]
    if m not in known_learners:
        return "unknown_learner"
    if num_fragments is not None and not 0 <= header["fragment"] < num_fragments:
        return "unknown_fragment"
    if inc < known_learners[m]:
        return "dead_incarnation"
    if inc > known_learners[m]:  # a restart is reported by the runtime (on_live_change), never by a frame
        return "unknown_incarnation"
    if (m, inc) in last_seq and header["seq"] <= last_seq[(m, inc)]:
        return "duplicate"
    staleness = current_version - header["base_version"]
    if staleness < 0:  # the learner claims a version the syncer never published
        return "future_version"
    if max_staleness is not None and staleness > max_staleness:
        return "stale"
    c_steps, c_tokens = header["c_steps"], header["c_tokens"]
    if max_steps is not None and c_steps > max_steps:
        return "bad_counter"
    if step_tokens is not None and c_tokens > c_steps * step_tokens:
        return "bad_counter"
    return None
