"""The frame checksum: a blake2b tree hash over fixed pieces of the payload, so the pieces are
hashed on every host core and the digest never depends on how many there are
(docs/design.md#messages).

A payload is cut into PIECE-byte pieces, the last one shorter (none for an empty payload). Each
piece is hashed alone (blake2b-128, personalised as a piece); the digest is blake2b-64,
personalised as the root, over the payload's length and PIECE as two uint64 LE followed by the
piece digests in order. The length prefix fixes how many pieces there are and where each ends, so
no two payloads share a root input, and the personalisations keep a piece's hash from being read
as a root's. One stream over the payload (the DLC1 frames' checksum) ran at about 1 GB/s on one
core: 20 ms per 20 MB contribution, admitted one at a time (docs/experiments.md#frame-checksum).
"""

from __future__ import annotations

import hashlib
import struct

from diloco.algo import hostpool

# Bytes per piece: about a millisecond of blake2b, against a few microseconds to hand a piece to a
# thread. Part of the wire format: changing it changes every digest (a new frame version).
PIECE = 1 << 20
PIECE_DIGEST_BYTES = 16  # a piece collision is no likelier than a root one
# 2**-64 per message that a corruption goes unseen: negligible over millions of messages, where
# crc32's 2**-32 is not. A forger is the HMAC's to stop (diloco/algo/auth.py), not this digest's.
DIGEST_BYTES = 8
_LEAF = b"diloco/piece"
_ROOT = b"diloco/root"
_PREFIX = struct.Struct("<QQ")  # payload length, PIECE


def _piece(view: memoryview, lo: int, hi: int) -> bytes:
    # hashlib releases the GIL while it hashes a buffer this large, and a memoryview slice is not a copy
    return hashlib.blake2b(view[lo:hi], digest_size=PIECE_DIGEST_BYTES, person=_LEAF).digest()


def checksum(payload: bytes | bytearray | memoryview) -> str:
    """The payload's tree digest, as 16 hex characters; the same on any number of threads."""
    view = memoryview(payload).cast("B")
    n = view.nbytes
    spans = hostpool.pieces(n, PIECE)
    leaves = hostpool.run([lambda lo=lo, hi=hi: _piece(view, lo, hi) for lo, hi in spans], len(spans) > 1)
    root = hashlib.blake2b(_PREFIX.pack(n, PIECE), digest_size=DIGEST_BYTES, person=_ROOT)
    for leaf in leaves:
        root.update(leaf)
    return root.hexdigest()
