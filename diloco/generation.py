"""What scripts/generate.py does: resolve a checkpoint, render prompts or chats, generate, report.

The model side is diloco/model/generate.py; checkpoints come from diloco.hf (docs/models.md).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from diloco.config import ConfigError, from_dict
from diloco.hf import CheckpointError, Pretrained, load, resolve
from diloco.model.generate import Generated, Sampling, generate, sampling_errors


@dataclass(frozen=True)
class GenerateConfig:
    checkpoint: str = "smollm2"
    prompt: tuple[str, ...] = ()
    chat: tuple[str, ...] = ()
    system: str = ""
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    dtype: str = "float32"

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_k, self.top_p)


def parse(raw: dict) -> GenerateConfig:
    cfg = from_dict(GenerateConfig, raw)
    errors = sampling_errors(cfg.sampling)
    if not cfg.prompt and not cfg.chat:
        errors.append("nothing to do: give prompt='[...]' or chat='[...]'")
    if cfg.max_new_tokens <= 0:
        errors.append(f"max_new_tokens={cfg.max_new_tokens} must be > 0")
    if cfg.dtype not in ("float32", "bfloat16"):
        errors.append(f"dtype={cfg.dtype!r} not in float32|bfloat16")
    if errors:
        raise ConfigError("invalid generate config:\n  " + "\n  ".join(errors))
    return cfg


def prompts_of(cfg: GenerateConfig, pre: Pretrained) -> tuple[list[str], list[list[int]]]:
    """(what to show, token ids) for every prompt and chat of the config."""
    tok = pre.tokenizer
    if tok is None:
        raise CheckpointError(f"{pre.path} has no tokenizer.json, so text cannot be encoded")
    shown, ids = [], []
    for text in cfg.prompt:
        shown.append(text)
        ids.append(tok.encode(text))
    for text in cfg.chat:
        messages = ([{"role": "system", "content": cfg.system}] if cfg.system else []) + \
                   [{"role": "user", "content": text}]
        shown.append(text)
        ids.append(tok.apply_chat_template(messages, add_generation_prompt=True))
    return shown, ids


def run(cfg: GenerateConfig, out=sys.stdout) -> tuple[list[str], Generated]:
    """Generate for every prompt and chat, print each reply and the speed; return the replies."""
    pre = load(resolve(cfg.checkpoint), dtype=cfg.dtype)
    shown, ids = prompts_of(cfg, pre)
    stream = len(ids) == 1
    state = {"ids": [], "printed": ""}

    def on_step(tokens_B):
        # Decode the whole reply each time: one token may end mid-character in byte-level BPE.
        state["ids"].append(int(tokens_B[0]))
        text = pre.tokenizer.decode([t for t in state["ids"] if t not in pre.tokenizer.stop_ids])
        if text.startswith(state["printed"]) and not text.endswith("\ufffd"):
            out.write(text[len(state["printed"]):])
            out.flush()
            state["printed"] = text

    if stream:
        print(f"> {shown[0]}", file=out)
    result = generate(pre.model, pre.config, ids, cfg.max_new_tokens, cfg.sampling,
                      stop_ids=pre.tokenizer.stop_ids, seed=cfg.seed, on_step=on_step if stream else None)
    replies = [pre.tokenizer.decode(t) for t in result.tokens]
    if stream:
        out.write(replies[0][len(state["printed"]):] + "\n")
    else:
        for text, reply in zip(shown, replies):
            print(f"> {text}\n{reply}\n", file=out)
    print(f"[{len(ids)} prompt(s), {sum(map(len, result.tokens))} new tokens; compile {result.compile_s:.1f} s, "
          f"{result.run_s:.2f} s, {result.tokens_per_s:.1f} tokens/s]", file=out)
    return replies, result
