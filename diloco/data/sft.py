"""Supervised fine-tuning data: conversations from JSONL, rendered with a checkpoint's chat
template, a loss mask on exactly the assistant's tokens, packed into rows with segment ids
(docs/design.md#fine-tuning-data).

A line is {"prompt": ..., "response": ...} (optionally "system") or {"messages": [{"role",
"content"}, ...]}. The mask comes from the rendering itself, never from pad or eos ids (pad may
equal eos): with {% generation %} blocks in the template, from their spans; otherwise by
rendering each prefix of the conversation, so an assistant turn is the text between the
template's generation prompt and the end of that turn, its end-of-turn token included.

Packing puts several examples into one row of seq_len + 1 tokens. Each example is a segment:
attention never crosses segments, positions restart at 0 in each, and the loss at a position
counts only if the next token is an assistant token of the same segment. The batch at a step is
a pure function of (seed, learner, step), from rows dealt disjointly to the learners.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from diloco.data.errors import DataError

ROLES = ("system", "user", "assistant", "tool")


class Example(NamedTuple):
    ids: np.ndarray  # int32 [n]
    mask: np.ndarray  # bool [n]: the assistant's tokens, trained on


class Rows(NamedTuple):
    """Packed rows, each seq_len + 1 tokens: what every batch is drawn from."""

    tokens: np.ndarray  # int32 [R, L + 1]
    segments: np.ndarray  # int32 [R, L + 1]: 1, 2, ... per example in the row; 0 = padding
    positions: np.ndarray  # int32 [R, L + 1]: restart at 0 in each segment
    targets: np.ndarray  # bool [R, L]: the loss at t (predicting t + 1) counts


@dataclass(frozen=True)
class Counts:
    examples: int = 0
    skipped: int = 0  # bad lines skipped (on_bad="skip")
    truncated: int = 0  # longer than a row, cut (too_long="truncate")
    dropped: int = 0  # longer than a row and dropped, or nothing left to train on after the cut
    trained_tokens: int = 0  # assistant tokens in the rows


def _conversation(obj: Any, where: str) -> list[dict]:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a line must be a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: messages must be a non-empty list")
    elif "prompt" in obj or "response" in obj:
        for k in ("prompt", "response"):
            if not isinstance(obj.get(k), str):
                raise DataError(f"{where}: {k!r} must be a string, got {type(obj.get(k)).__name__}")
        messages = ([{"role": "system", "content": obj["system"]}] if obj.get("system") else []) + [
            {"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["response"]}]
    else:
        raise DataError(f"{where}: want {{'prompt', 'response'}} or {{'messages': [...]}}, got keys {sorted(obj)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{i}] must be {{'role': str, 'content': str}}, got {str(m)[:80]}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: messages[{i}] has unknown role {m['role']!r} (known: {', '.join(ROLES)})")
        if m["role"] == "assistant" and not m["content"].strip():
            raise DataError(f"{where}: messages[{i}] is an empty assistant response")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_conversations(path: str | Path, on_bad: str = "error") -> tuple[list[list[dict]], int]:
    """Every conversation of a JSONL file, and how many bad lines were skipped (on_bad="skip");
    on_bad="error": the first bad line is a DataError naming the file and line."""
    path = Path(path)
    if on_bad not in ("error", "skip"):
        raise DataError(f"on_bad={on_bad!r} not in error|skip")
    out, skipped = [], 0
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: invalid UTF-8 at byte offset {e.start}") from None
    except OSError as e:
        raise DataError(f"{path}: {e.strerror or e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as e:
                raise DataError(f"{where}: not JSON ({str(e)[:80]})") from None
            out.append(_conversation(obj, where))
        except DataError:
            if on_bad == "error":
                raise
            skipped += 1
    if not out:
        raise DataError(f"{path}: no usable conversation ({skipped} bad lines skipped)")
    return out, skipped


def _prefix_spans(tok, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendering, and the character span of each assistant turn: from the end of the
    rendering of the turns before it with the generation prompt to the end of the rendering up to
    and including it. A template whose renderings are not prefixes of each other cannot be
    masked this way: a DataError says so."""
    text = tok.render_chat(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.render_chat(messages[:i], add_generation_prompt=True)
        through = tok.render_chat(messages[:i + 1])
        if not (text.startswith(through) and through.startswith(before)) or len(through) <= len(before):
            raise DataError("the chat template does not render a conversation's turns as prefixes of "
                            "each other, so the assistant's tokens cannot be found; give it "
                            "{% generation %} blocks")
        spans.append((len(before), len(through)))
    return text, spans


def render(tok, messages: list[dict]) -> Example:
    """Token ids of the conversation as the template renders it and the mask of the assistant's
    tokens (a token is the assistant's if it starts inside an assistant span)."""
    if tok.marks_assistant:
        ids, mask = tok.apply_chat_template(messages, return_assistant_tokens_mask=True)
        return Example(np.asarray(ids, np.int32), np.asarray(mask, bool))
    text, spans = _prefix_spans(tok, messages)
    encoding = tok.tok.encode(text, add_special_tokens=False)
    starts = np.asarray([s for s, _ in encoding.offsets], np.int64)
    mask = np.zeros(len(encoding.ids), bool)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < hi)
    return Example(np.asarray(encoding.ids, np.int32), mask)


def pack(examples: list[Example], seq_len: int, too_long: str = "truncate",
         seed: int = 0) -> tuple[Rows, Counts]:
    """Examples into rows of seq_len + 1 tokens, first fit in a seeded order. An example longer
    than a row is cut to it (too_long="truncate") or left out ("drop"); one with no assistant
    token left to predict is dropped. Counted."""
    if too_long not in ("truncate", "drop"):
        raise DataError(f"too_long={too_long!r} not in truncate|drop")
    width = seq_len + 1
    truncated = dropped = 0
    kept: list[Example] = []
    for e in examples:
        if len(e.ids) > width:
            if too_long == "drop":
                dropped += 1
                continue
            e, truncated = Example(e.ids[:width], e.mask[:width]), truncated + 1
        if not e.mask[1:].any():  # the first token is never a target
            dropped += 1
            continue
        kept.append(e)
    if not kept:
        raise DataError(f"no example fits a row of seq_len+1={width} tokens with anything to train on "
                        f"({dropped} dropped); raise data.seq_len or pass too_long=truncate")
    order = np.random.default_rng([seed, 11]).permutation(len(kept))
    rows: list[list[int]] = []  # example indices per row
    room: list[int] = []
    for i in order:
        n = len(kept[i].ids)
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(width - n)
    R = len(rows)
    tokens = np.zeros((R, width), np.int32)
    segments = np.zeros((R, width), np.int32)
    positions = np.zeros((R, width), np.int32)
    assistant = np.zeros((R, width), bool)
    for r, members in enumerate(rows):
        at = 0
        for s, i in enumerate(members, 1):
            e = kept[i]
            n = len(e.ids)
            tokens[r, at:at + n], segments[r, at:at + n] = e.ids, s
            positions[r, at:at + n], assistant[r, at:at + n] = np.arange(n), e.mask
            at += n
    targets = assistant[:, 1:] & (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    counts = Counts(len(examples), 0, truncated, dropped, int(targets.sum()))
    return Rows(tokens, segments, positions, targets), counts


def batch_at(rows: Rows, *, seed: int, learner: int, num_learners: int, step: int,
             batch_size: int) -> dict[str, np.ndarray]:
    """The batch of `learner` at `step`: rows dealt round-robin (row r to learner r mod M, so the
    shards are disjoint), drawn in a seeded order per pass over the shard; a pure function of
    (seed, learner, step)."""
    shard = np.arange(learner, len(rows.tokens), num_learners)
    if len(shard) == 0:
        raise DataError(f"learner {learner} of {num_learners} gets no packed row ({len(rows.tokens)} "
                        "rows in all); use fewer learners or more data")
    picks = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(k, len(shard))
        picks.append(shard[np.random.default_rng([seed, learner, epoch]).permutation(len(shard))[i]])
    picks = np.asarray(picks)
    return {"tokens": rows.tokens[picks], "segments": rows.segments[picks],
            "positions": rows.positions[picks], "targets": rows.targets[picks]}


def eval_batches(rows: Rows, *, batch_size: int, n: int) -> list[dict[str, np.ndarray]]:
    """Up to n batches of the first rows in order, the last padded with empty rows (no target, so
    no weight in the masked loss): the fixed held-out batches every eval of a run reads."""
    count = min(n * batch_size, len(rows.tokens))
    out = []
    for lo in range(0, count, batch_size):
        take = np.arange(lo, min(lo + batch_size, count))
        pad = batch_size - len(take)
        batch = {k: getattr(rows, k)[take] for k in Rows._fields}
        out.append({k: np.concatenate([v, np.zeros((pad, *v.shape[1:]), v.dtype)]) for k, v in batch.items()})
    return out


def trained_ids(rows: Rows) -> np.ndarray:
    """The token ids the loss predicts (each target position's next token), in row order."""
    return rows.tokens[:, 1:][rows.targets]


def _rendered(paths: list[Path], tok, on_bad: str) -> tuple[list[Example], int]:
    """Every conversation of the JSONL files rendered with `tok`'s chat template, and how many bad
    lines were skipped."""
    examples, skipped = [], 0
    for path in paths:
        conversations, bad = read_conversations(path, on_bad)
        skipped += bad
        for i, messages in enumerate(conversations):
            try:
                examples.append(render(tok, messages))
            except DataError as e:
                raise DataError(f"{path}: conversation {i + 1}: {e}") from None
            except Exception as e:  # the template's own raise_exception, a jinja error
                raise DataError(f"{path}: conversation {i + 1}: the chat template refused it "
                                f"({type(e).__name__}: {e})") from None
    return examples, skipped


def load(paths: list[Path], tok, *, seq_len: int, val_fraction: float, too_long: str = "truncate",
         on_bad: str = "error", eval_paths: list[Path] = ()) -> tuple[Rows, Rows, dict[str, int]]:
    """Every conversation of the JSONL files rendered with `tok`'s chat template and packed, with
    held-out rows to evaluate on: those of `eval_paths` (data.eval_paths) when given, else a fixed
    random val_fraction of the conversations (at least one): (train rows, val rows, counts). The
    split and the packing depend on the data alone, not on run.seed, so runs with different seeds
    evaluate on the same examples."""
    if tok is None or tok.chat_template is None:
        raise DataError("data.source=sft needs a tokenizer with a chat template to render the "
                        "conversations; the checkpoint of model.init_from has none")
    examples, skipped = _rendered(paths, tok, on_bad)
    if eval_paths:
        train_examples = examples
        val_examples, bad = _rendered(eval_paths, tok, on_bad)
        skipped += bad
    else:
        n_val = max(1, int(len(examples) * val_fraction))
        if len(examples) - n_val < 1:
            raise DataError(f"{len(examples)} conversations in data.paths leave none to train on after "
                            f"holding out data.val_fraction={val_fraction}; add conversations or give "
                            "data.eval_paths")
        held = np.zeros(len(examples), bool)
        held[np.random.default_rng([0, 17]).permutation(len(examples))[:n_val]] = True
        train_examples = [e for e, h in zip(examples, held) if not h]
        val_examples = [e for e, h in zip(examples, held) if h]
    train, tc = pack(train_examples, seq_len, too_long)
    val, vc = pack(val_examples, seq_len, too_long)
    counts = {"examples": len(train_examples) + len(val_examples), "val_examples": len(val_examples),
              "skipped": skipped, "truncated": tc.truncated + vc.truncated, "dropped": tc.dropped + vc.dropped,
              "train_rows": len(train.tokens), "val_rows": len(val.tokens)}
    return train, val, counts
