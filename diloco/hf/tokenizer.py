"""A checkpoint's tokenizer, special tokens and chat template, as transformers 5 reads them.

Reference: transformers src/transformers/tokenization_utils_base.py (`_from_pretrained`,
`save_pretrained`, `save_chat_templates`, `special_tokens_map`, `apply_chat_template`) and
src/transformers/tokenization_utils_tokenizers.py (`TokenizersBackend`); the rendering itself is
in diloco/hf/chat.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import processors

from diloco.data.tokenizer import Tokenizer
from diloco.hf import chat
from diloco.hf.source import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"  # legacy: read, never written by v5
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # v5 keeps the template here, not in the config
GENERATION_CONFIG_FILE = "generation_config.json"

NAMED = ("bos_token", "eos_token", "unk_token", "pad_token")  # the four HFTokenizer fields
OTHER_NAMED = ("sep_token", "cls_token", "mask_token")  # the rest of SPECIAL_TOKENS_ATTRIBUTES
# transformers arguments with no equivalent here: passed on they would silently become
# template variables instead of doing what the caller meant.
_UNSUPPORTED = ("continue_final_message", "chat_template", "sanitize_control_tokens",
                "return_tensors", "tokenizer_kwargs", "padding", "truncation")


@dataclass(frozen=True)
class HFTokenizer:
    """tokenizer.json's tokenizer with the named special tokens and chat template around it.

    add_bos_token/add_eos_token say what encode(text) adds; from_parts reads them off the
    post-processor, which is what transformers' tokenizer(text) runs.
    """

    tok: tokenizers.Tokenizer
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    add_bos_token: bool
    add_eos_token: bool
    stop_ids: tuple[int, ...]  # ids that end generation: eos plus generation_config's eos_token_id
    # sep/cls/mask and model-specific named tokens (image_token, ...): transformers puts every
    # named special token in the template's scope, so a template may read any of them.
    other_special_tokens: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        for flag, name in ((self.add_bos_token, "bos_token"), (self.add_eos_token, "eos_token")):
            if flag and self._id(name) is None:
                raise ValueError(f"add_{name}=True but {name}={getattr(self, name)!r} has no id "
                                 f"in the vocabulary")

    def _id(self, name: str) -> int | None:
        text = getattr(self, name)
        return None if text is None else self.tok.token_to_id(text)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """What transformers' tokenizer.special_tokens_map holds: set named tokens only (v5)."""
        named = {name: getattr(self, name) for name in NAMED if getattr(self, name) is not None}
        return {**named, **dict(self.other_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            ids = [self.bos_id] * self.add_bos_token + ids + [self.eos_id] * self.add_eos_token
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in np.asarray(ids).reshape(-1)],
                               skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages, add_generation_prompt: bool = False, *, tools=None,
                    documents=None, return_generation_spans: bool = False, **kwargs):
        """The conversation as the template writes it; with return_generation_spans, also the
        (start, end) character span of every {% generation %} block."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (none in tokenizer_config.json "
                             "or chat_template.jinja), so it cannot render a conversation")
        unsupported = [k for k in _UNSUPPORTED if k in kwargs]
        if unsupported:
            raise ValueError(f"apply_chat_template arguments {unsupported} are not supported here")
        text, spans = chat.render(self.chat_template, messages,
                                  add_generation_prompt=add_generation_prompt, tools=tools,
                                  documents=documents,
                                  variables={**self.special_tokens_map, **kwargs})
        return (text, spans) if return_generation_spans else text

    @property
    def marks_assistant(self) -> bool:
        """Whether the chat template marks the assistant's turns ({% generation %} blocks), so
        apply_chat_template can return the mask of the assistant's tokens."""
        return self.chat_template is not None and chat.has_generation_blocks(self.chat_template)

    def for_training(self) -> Tokenizer:
        """The training pipeline's view (diloco/data/tokenizer.py): no special tokens added, int32
        ids, specials kept on decode. A method, so diloco/data uses a checkpoint's tokenizer
        without importing this package."""

        def encode(text: str) -> np.ndarray:
            # One call over the whole text: a cut that is safe for GPT-2's split regex is not safe
            # for every pre-tokenizer (a Metaspace one prepends '▁' to each piece).
            return np.asarray(self.encode(text, add_special_tokens=False), dtype=np.int32)

        def decode(ids) -> str:
            return self.decode(ids, skip_special_tokens=False)

        return Tokenizer("hf", self.vocab_size, encode, decode)

    def apply_chat_template(self, messages, add_generation_prompt: bool = False,
                            tokenize: bool = True, return_assistant_tokens_mask: bool = False,
                            return_dict: bool = False, **kwargs):
        """Text (tokenize=False), ids, or (ids, assistant mask): transformers' result with
        return_dict=False, and its input_ids/assistant_masks with return_dict=True."""
        if return_dict:
            raise ValueError("return_dict=True is not supported: ids (and the mask) come back "
                             "as a list (a tuple of two lists)")
        if return_assistant_tokens_mask and not tokenize:
            raise ValueError("return_assistant_tokens_mask=True needs tokenize=True")
        text, spans = self.render_chat(messages, add_generation_prompt,
                                       return_generation_spans=True, **kwargs)
        if not tokenize:
            return text
        # The template writes every special token itself, bos included.
        encoding = self.tok.encode(text, add_special_tokens=False)
        if not return_assistant_tokens_mask:
            return encoding.ids
        if not self.marks_assistant:
            # transformers only warns and returns all zeros, which would train on nothing.
            raise ValueError("return_assistant_tokens_mask=True but the chat template has no "
                             "{% generation %} block to mark the assistant's tokens")
        return encoding.ids, chat.assistant_mask(encoding, spans)


def _token_text(value, where: str) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise CheckpointError(f"{where} is {value!r}: expected a string or an AddedToken dict "
                          f"with a string 'content'")


def _added_token(value, text: str) -> tokenizers.AddedToken:
    props = {k: value[k] for k in ("single_word", "lstrip", "rstrip", "normalized")
             if isinstance(value, dict) and k in value}
    return tokenizers.AddedToken(text, special=True, **props)


def _chat_template(value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        by_name = {t["name"]: t["template"] for t in value}
        if "default" in by_name:
            return by_name["default"]
        raise CheckpointError(f"tokenizer_config['chat_template'] holds templates "
                              f"{sorted(by_name)} and none is named 'default'")
    raise CheckpointError(f"tokenizer_config['chat_template'] is a {type(value).__name__}: "
                          f"expected a string or a list of {{'name', 'template'}} dicts")


def _other_named(config: dict) -> list[tuple[str, object]]:
    """sep/cls/mask plus the model-specific named tokens v5 collects in `_from_pretrained`."""
    found = [(k, config[k]) for k in OTHER_NAMED if config.get(k) is not None]
    # v5 takes any other *_token key only while it is still a plain string, before AddedToken
    # dicts are decoded, and every entry of an extra_special_tokens dict.
    found += [(k, v) for k, v in config.items()
              if k.endswith("_token") and k not in NAMED + OTHER_NAMED and isinstance(v, str)]
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        found += list(extra.items())
    return found


def _extra_list(config: dict) -> list:
    """The unnamed special tokens (v5's extra_special_tokens, once additional_special_tokens)."""
    extra = config.get("extra_special_tokens")
    if not (isinstance(extra, list) and extra):
        extra = config.get("additional_special_tokens")
    return extra if isinstance(extra, list) else []


def _post_processor_flags(tok: tokenizers.Tokenizer, bos_id, eos_id) -> tuple[bool, bool]:
    """Whether tokenizer(text) adds bos / eos: v5 drops add_bos_token and add_eos_token from
    tokenizer_config.json whenever tokenizer.json exists, so the post-processor decides."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for add_bos in (False, True):
        for add_eos in (False, True):
            if (add_bos and bos_id is None) or (add_eos and eos_id is None):
                continue
            if full == [bos_id] * add_bos + plain + [eos_id] * add_eos:
                return add_bos, add_eos
    raise CheckpointError(f"tokenizer.json's post-processor turns {plain} into {full}, which "
                          f"is not bos (id {bos_id}) / eos (id {eos_id}) around the text")


def _stop_ids(eos_id, generation_config: dict | None) -> tuple[int, ...]:
    extra = (generation_config or {}).get("eos_token_id")
    extra = [] if extra is None else [extra] if isinstance(extra, int) else extra
    if not isinstance(extra, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                              for i in extra):
        raise CheckpointError(f"generation_config['eos_token_id'] is {extra!r}: expected an int "
                              f"or a list of ints")
    ids = ([] if eos_id is None else [eos_id]) + extra
    return tuple(dict.fromkeys(ids))  # first occurrence wins, eos first


def from_parts(tok: tokenizers.Tokenizer, tokenizer_config: dict,
               generation_config: dict | None = None) -> HFTokenizer:
    """The tokenizer transformers v5 builds from tokenizer.json plus these configs.

    tok is not modified: named special tokens it lacks are added (as v5's TokenizersBackend
    does) to a copy, which also has tokenizer.json's truncation and padding switched off, since
    transformers turns them off for every call that does not ask for them.
    """
    if not isinstance(tokenizer_config, dict):
        raise CheckpointError(f"tokenizer_config is a {type(tokenizer_config).__name__}, "
                              f"not a dict")
    raw = {name: tokenizer_config.get(name) for name in NAMED}
    if raw["pad_token"] is None and tok.padding is not None:
        raw["pad_token"] = tok.padding.get("pad_token")  # v5 falls back to tokenizer.json's
    texts = {name: _token_text(v, f"tokenizer_config[{name!r}]") for name, v in raw.items()}
    others = [(k, v, _token_text(v, f"tokenizer_config[{k!r}]"))
              for k, v in _other_named(tokenizer_config)]
    extra = [(v, _token_text(v, "tokenizer_config['extra_special_tokens']"))
             for v in _extra_list(tokenizer_config)]
    # Every special token becomes an added special token of the backend, as in v5's
    # TokenizersBackend._post_init: one that is only in the model's vocabulary keeps its id but
    # is no longer split and is skipped on decode; one that is nowhere gets a new id.
    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    wanted = [(raw[n], texts[n]) for n in NAMED] + [(v, text) for _, v, text in others] + extra
    missing = list({text: _added_token(v, text) for v, text in wanted
                    if text is not None and text not in added}.values())
    if missing or tok.truncation is not None or tok.padding is not None:
        tok = tokenizers.Tokenizer.from_str(tok.to_str())
        tok.no_truncation()
        tok.no_padding()
        tok.add_special_tokens(missing)
    ids = {n: None if texts[n] is None else tok.token_to_id(texts[n])
           for n in ("bos_token", "eos_token")}
    add_bos, add_eos = _post_processor_flags(tok, ids["bos_token"], ids["eos_token"])
    return HFTokenizer(
        tok=tok, **texts,
        chat_template=_chat_template(tokenizer_config.get("chat_template")),
        add_bos_token=add_bos, add_eos_token=add_eos,
        stop_ids=_stop_ids(ids["eos_token"], generation_config),
        other_special_tokens=tuple((k, text) for k, _, text in others))


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: holds a {type(value).__name__}, expected a JSON object")
    return value


def load_tokenizer(folder: str | Path) -> HFTokenizer | None:
    """The folder's tokenizer, or None when it has no tokenizer.json."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such folder")
    if not (folder / TOKENIZER_FILE).is_file():
        return None
    try:
        tok = tokenizers.Tokenizer.from_file(str(folder / TOKENIZER_FILE))
    except Exception as e:  # the Rust side raises a bare Exception for any parse failure
        raise CheckpointError(f"{folder / TOKENIZER_FILE}: not a readable tokenizers file: "
                              f"{e}") from e
    config = _read_json(folder / CONFIG_FILE) or {}
    # Legacy special_tokens_map.json overrides the config, but only for a config without
    # added_tokens_decoder (v5 `_from_pretrained`).
    special_map = _read_json(folder / SPECIAL_TOKENS_MAP_FILE)
    if special_map and "added_tokens_decoder" not in config:
        config.update({k: v for k, v in special_map.items() if k != "extra_special_tokens"})
    template_file = folder / CHAT_TEMPLATE_FILE
    if template_file.is_file():  # takes priority over a template inside the config
        try:
            config["chat_template"] = template_file.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{template_file}: not UTF-8 text: {e}") from e
    generation_config = _read_json(folder / GENERATION_CONFIG_FILE)
    try:
        return from_parts(tok, config, generation_config)
    except CheckpointError as e:
        raise CheckpointError(f"{folder}: {e}") from e


def _with_flags(t: HFTokenizer) -> tokenizers.Tokenizer:
    """t.tok, with a post-processor that adds exactly what t.add_bos_token/add_eos_token say:
    tokenizer.json is the only place v5 reads them from."""
    current = _post_processor_flags(t.tok, t.bos_id, t.eos_id)
    if current == (t.add_bos_token, t.add_eos_token):
        return t.tok
    bos = f"{t.bos_token}:0 " if t.add_bos_token else ""
    eos = f" {t.eos_token}:0" if t.add_eos_token else ""
    specials = ([(t.bos_token, t.bos_id)] * t.add_bos_token
                + [(t.eos_token, t.eos_id)] * t.add_eos_token)
    template = processors.TemplateProcessing(single=f"{bos}$A:0{eos}", pair=f"{bos}$A:0{eos} $B:1",
                                             special_tokens=specials)
    tok = tokenizers.Tokenizer.from_str(t.tok.to_str())
    # A post-processor that adds nothing may still trim offsets (ByteLevel); keep it in front.
    old = tok.post_processor
    keep = old is not None and current == (False, False)
    tok.post_processor = processors.Sequence([old, template]) if keep else template
    return tok


def save_tokenizer(t: HFTokenizer, folder: str | Path) -> None:
    """Write the files transformers 5 writes, so AutoTokenizer.from_pretrained(folder) loads the
    same special tokens and template: tokenizer.json, tokenizer_config.json (no template, no
    add_bos_token/add_eos_token) and chat_template.jinja."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _with_flags(t).save(str(folder / TOKENIZER_FILE))
    config = {**t.special_tokens_map, "clean_up_tokenization_spaces": False,
              "tokenizer_class": "PreTrainedTokenizerFast"}  # v5's alias of TokenizersBackend
    (folder / CONFIG_FILE).write_text(
        json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    template_file = folder / CHAT_TEMPLATE_FILE
    if t.chat_template is not None:
        template_file.write_text(t.chat_template, encoding="utf-8")
    elif template_file.exists():
        template_file.unlink()  # a stale template would come back to life on the next load
    special_map = folder / SPECIAL_TOKENS_MAP_FILE
    if special_map.exists():  # v5 writes none, but a stale one would override the config
        special_map.write_text(json.dumps(t.special_tokens_map, indent=2, sort_keys=True,
                                          ensure_ascii=False) + "\n", encoding="utf-8")
    # Stop ids beyond eos live in generation_config.json. Touch it only when what it says
    # differs, keeping whatever else it holds (the model exporter writes one too).
    gen_file = folder / GENERATION_CONFIG_FILE
    gen = _read_json(gen_file)
    if _stop_ids(t.eos_id, gen) != t.stop_ids:
        gen = gen or {}
        gen["eos_token_id"] = list(t.stop_ids)
        gen_file.write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n", encoding="utf-8")
