"""Tokenizers as a NamedTuple of pure functions: raw UTF-8 bytes, or byte-level BPE.

Reference: Sennrich et al., "Neural Machine Translation of Rare Words with Subword Units"
(arXiv 1508.07909); byte-level pre-tokenization as in GPT-2 (Radford et al., 2019).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import tokenizers as hf

# Encode in pieces of about this many characters: one multi-megabyte string makes the HF
# tokenizer hold per-token offsets for the whole corpus at once.
ENCODE_CHUNK_CHARS = 1 << 16

# A lone newline between two non-space characters is a pre-token of its own under the GPT-2
# split regex, so cutting right after it gives the same tokens as encoding the whole text. A
# newline inside a longer whitespace run is not a safe cut: the regex gives the run's last
# character to the next pre-token, which a cut would change.
_SAFE_CUT = re.compile(r"(?<=\S)\n(?=\S)")


class Tokenizer(NamedTuple):
    """kind names the scheme; ids are in [0, vocab_size)."""

    kind: str
    vocab_size: int
    encode: Callable[[str], np.ndarray]  # text -> int32 [n]
    decode: Callable[[np.ndarray], str]  # ids -> text (invalid UTF-8 becomes U+FFFD)
    # The same ids as a Hugging Face tokenizer, written beside an exported model (diloco/hf).
    hf: hf.Tokenizer | None = None


def byte_tokenizer() -> Tokenizer:
    """One token per UTF-8 byte: vocab 256, nothing to train, exact round trip."""

    def encode(text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(ids) -> str:
        return np.asarray(ids, dtype=np.uint8).tobytes().decode("utf-8", errors="replace")

    return Tokenizer("byte", 256, encode, decode, _byte_level_hf())


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte: printable Latin-1 bytes are themselves, the rest
    are shifted past U+0100 in byte order (Radford et al. 2019, the released encoder)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


def _byte_level_hf() -> hf.Tokenizer:
    """The byte tokenizer as an HF tokenizer: a byte-level BPE without merges, id = byte value."""
    tok = hf.Tokenizer(hf.models.BPE({c: b for b, c in enumerate(_gpt2_byte_chars())}, []))
    tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = hf.decoders.ByteLevel()
    return tok


def _new_bpe() -> hf.Tokenizer:
    tok = hf.Tokenizer(hf.models.BPE())
    # No prefix space: the corpus is one stream, and a round trip must give back the exact text.
    tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hf.decoders.ByteLevel()
    return tok


def train_bpe(text: str, vocab_size: int) -> hf.Tokenizer:
    """Byte-level BPE with at most vocab_size ids (fewer if the text runs out of pairs to merge)."""
    tok = _new_bpe()
    trainer = hf.trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(split_for_encoding(text), trainer=trainer)
    return tok


def split_for_encoding(text: str, target: int = ENCODE_CHUNK_CHARS) -> Iterator[str]:
    """Pieces of about `target` characters, cut only where BPE tokens cannot straddle the cut."""
    start = 0
    while start < len(text):
        cut = _SAFE_CUT.search(text, min(start + target, len(text)))
        end = cut.end() if cut else len(text)
        yield text[start:end]
        start = end


def bpe_tokenizer(tok: hf.Tokenizer, vocab_size: int) -> Tokenizer:
    """Wrap a trained HF tokenizer. vocab_size is the configured size, which the model's embedding
    uses even when a small corpus left the trained vocabulary short of it."""
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"trained vocabulary has {tok.get_vocab_size()} ids, more than {vocab_size}")

    def encode(text: str) -> np.ndarray:
        pieces = [np.asarray(e.ids, dtype=np.int32)
                  for e in tok.encode_batch(list(split_for_encoding(text)))]
        return np.concatenate(pieces) if pieces else np.zeros(0, np.int32)

    def decode(ids) -> str:
        return tok.decode([int(i) for i in np.asarray(ids).reshape(-1)])

    return Tokenizer("bpe", vocab_size, encode, decode, tok)


def save_bpe(tok: hf.Tokenizer, path: Path) -> None:
    tok.save(str(path))


def load_bpe(path: Path, vocab_size: int) -> Tokenizer:
    return bpe_tokenizer(hf.Tokenizer.from_file(str(path)), vocab_size)
