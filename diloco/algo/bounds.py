"""Bounds on what bytes from an untrusted peer can make the syncer do: parse, admit, publish.

Reference: docs/algorithm.md#bounds-on-what-a-frame-can-claim. Everything here is pure and cheap next
to decoding a fragment; the syncer (diloco/algo/syncer.py), the wire format (messages.py) and the
object store's pointers (diloco/store/json_objects.py) call it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

# A JSON string, escapes included; possessive, and the closing quote optional, so an unterminated
# string costs one linear scan (no backtracking over a hostile 1 MiB header).
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in `text`, strings skipped: json.loads recurses that deep."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    if not brackets:
        return 0
    codes = np.frombuffer(brackets.encode("ascii"), np.uint8)
    return int(np.cumsum(np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)).max())


def loads_json(raw: bytes | str, max_depth: int, **kw: Any) -> Any:
    """json.loads of UTF-8 bytes or a str, refusing documents nested deeper than `max_depth`.

    Every failure is a ValueError (UnicodeDecodeError is one); json.loads alone lets a 2 kB document
    nested 1,000 deep escape as RecursionError, which no caller expects.
    """
    text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray, memoryview)) else raw
    depth = json_depth(text)
    if depth > max_depth:
        raise ValueError(f"nested {depth} deep, more than {max_depth}")
    try:
        return json.loads(text, **kw)
    except RecursionError:  # unreachable after the depth check; kept so no caller ever sees one
        raise ValueError(f"nested too deep for the parser (limit {max_depth})") from None


def norm_fault(norm: float, recent: Sequence[float], norm_bound: float, theta_norm: float, size: int,
               theta_norm_bound: float) -> str:
    """Why a pseudo-gradient of `norm` per inner step is exploding, or "" to admit it.

    Against its peers: above norm_bound x the median of the fragment's `recent` nonzero norms, once
    8 are known (0 = off). Against Theta, from the first contribution on: above theta_norm_bound x
    (||Theta_p|| + sqrt(size_p)), an RMS move per step of that many times (RMS of Theta_p + 1).
    """
    recent = [n for n in recent if n > 0]  # a median of zeros would refuse every nonzero norm
    if norm_bound > 0 and len(recent) >= 8:
        median = float(np.median(recent))
        if norm > norm_bound * median:
            return f"norm per step {norm:.4g} > {norm_bound} x median {median:.4g}"
    if theta_norm_bound > 0 and norm > theta_norm_bound * (theta_norm + math.sqrt(size)):
        return f"norm per step {norm:.4g} > {theta_norm_bound} x (||Theta|| {theta_norm:.4g} + sqrt(size {size}))"
    return ""


def finite(arrays: Iterable[Any]) -> bool:
    """Every array (numpy or JAX, or a scalar) is free of inf and NaN."""
    return all(bool(np.isfinite(np.asarray(x)).all()) for x in arrays)
