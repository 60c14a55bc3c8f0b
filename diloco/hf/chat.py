"""Chat-template rendering that reproduces Hugging Face transformers 5.x byte for byte.

Reference: transformers src/transformers/utils/chat_template_utils.py (`_compile_jinja_template`,
`render_jinja_template`, `_render_with_assistant_indices`) and the mask loop at the end of
`PreTrainedTokenizerBase.apply_chat_template` in src/transformers/tokenization_utils_base.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The hidden context entry through which the {% generation %} tag finds the render that is
# running. transformers keeps this state on the (cached, shared) environment instead; a context
# entry gives the same numbers and lets two threads render one compiled template at once.
_TRACKER = "__diloco_generation_tracker__"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")  # the test transformers warns on
# Where a message's reasoning may come in; transformers copies it to the first and to "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render, or refused the conversation it was given."""


class _Raised(jinja2.TemplateError):
    """What the template's own raise_exception(message) throws: its message is the whole story."""


class _Tracker:
    """Characters yielded so far, and the (start, end) character span of each generation block."""

    def __init__(self) -> None:
        self.emitted = 0
        self.spans: list[tuple[int, int]] = []


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: renders its body unchanged and records its span."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_record", [jinja2.nodes.ContextReference()])
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _record(self, context, caller) -> str:
        text = caller()
        tracker = context.get(_TRACKER)
        # The start is what has been yielded so far, exactly as transformers measures it: a block
        # inside a macro or {% set %} body is measured from the wrong place there too.
        if tracker is not None:
            tracker.spans.append((tracker.emitted, tracker.emitted + len(text)))
        return text


def _raise_exception(message):
    raise _Raised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers replaces jinja's tojson, which HTML-escapes '<', '>', '&' and "'".
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _Dict:
    """The template's `dict`: builds dicts, but exposes no attribute of the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """The template's `namespace`, refusing underscore names (a way into CPython internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's trick, so namespace(self=1) still works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template may not set the underscore-prefixed namespace attribute {name!r}")


def plain(value):
    """value rebuilt from plain JSON-like types, as transformers does before the template sees it:
    the sandbox does not know which methods of a rich object (an array, an image) are unsafe."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (str, int, float):  # a subclass (an enum, ...) may carry extra methods
        if isinstance(value, base):
            return base(value) if base is not str else str.__str__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if isinstance(value, np.generic):
        return plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # a pydantic model
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"  # templates test media keys for presence, never read them


def normalize(messages) -> list[dict]:
    """The messages as transformers 5 hands them to the template: keys whose value is None are
    dropped (templates print "None" for them), everything is plain data, and reasoning given
    under any of its names is also under "reasoning_content" and "thinking"."""
    out = []
    for m in messages:
        m = plain({k: v for k, v in m.items() if v is not None})
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """The template in transformers' environment; compiled once per distinct source."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile: {e.message} "
                                f"(line {e.lineno})") from e


def has_generation_blocks(source: str) -> bool:
    return _GENERATION_TAG.search(source) is not None


def check_messages(messages) -> None:
    """Raise ValueError naming the first message that is not a {"role": str, "content": ...} dict.

    content is a string, a list of parts ({"type": "text", "text": str}, or other typed parts
    such as images, passed through to the template), or None or absent on a message that has
    tool_calls.
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a conversation needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] is a {type(m).__name__}, not a dict with role and "
                             f"content")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] has role {m.get('role')!r}: expected a string")
        content = m.get("content")
        if content is None and m.get("tool_calls") is not None:
            continue
        if "content" not in m:
            raise ValueError(f"messages[{i}] (role {m['role']!r}) has no 'content'")
        if isinstance(content, str):
            continue
        if not isinstance(content, (list, tuple)):
            raise ValueError(f"messages[{i}] (role {m['role']!r}) has content of type "
                             f"{type(content).__name__}: expected a string or a list of parts")
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise ValueError(f"messages[{i}].content[{j}] is {part!r}: expected a dict with "
                                 f"a string 'type'")
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}].content[{j}] is a text part without a string "
                                 f"'text': {part!r}")


def render(source: str, messages: Sequence[Mapping], *, add_generation_prompt: bool,
           tools: Sequence[Mapping] | None, documents: Sequence[Mapping] | None,
           variables: Mapping[str, object]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its generation blocks.

    variables are the special tokens' strings with the caller's extra kwargs laid over them,
    as transformers builds them: {**tokenizer.special_tokens_map, **kwargs}.
    """
    check_messages(messages)
    if tools is not None:
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise ValueError(f"tools[{i}] is a {type(tool).__name__}: pass a JSON schema dict "
                                 f"(transformers.utils.get_json_schema turns a function into one)")
        tools = plain(list(tools))
    if documents is not None:
        for i, doc in enumerate(documents):
            if not isinstance(doc, Mapping):
                raise ValueError(f"documents[{i}] is a {type(doc).__name__}: expected a dict "
                                 f"such as {{'title': ..., 'text': ...}}")
        documents = plain(documents)
    reserved = {"messages", "tools", "documents", "add_generation_prompt", _TRACKER}
    reserved &= set(variables)
    if reserved:
        raise ValueError(f"template variables {sorted(reserved)} are set by the renderer itself")
    template = compile_template(source)
    tracker = _Tracker()
    context = {**plain(dict(variables)), "messages": normalize(messages), "tools": tools,
               "documents": documents, "add_generation_prompt": add_generation_prompt,
               _TRACKER: tracker}
    pieces = []
    try:
        # generate() yields the same pieces render() joins; counting them as they come is how
        # transformers places each generation block in the final string.
        for piece in template.generate(**context):
            pieces.append(piece)
            tracker.emitted += len(piece)
    except _Raised as e:
        raise ChatTemplateError(str(e.message)) from e
    except Exception as e:  # jinja's errors, and a TypeError from '+' on the wrong types
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
    return "".join(pieces), tracker.spans


def assistant_mask(encoding, spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 on every token of a generation block, as transformers computes it from the offsets.

    Kept quirk for quirk: a block whose first character maps to no token ends the scan (there
    it means truncation), and an end that maps to no token (or to token 0) runs to the end. One
    difference: an empty block at the very start is skipped, where transformers crashes on it.
    """
    n = len(encoding.ids)
    mask = [0] * n
    for start, end in spans:
        if end == 0:
            continue
        first = encoding.char_to_token(start)
        last = encoding.char_to_token(end - 1)
        if first is None:
            break
        for k in range(first, last + 1 if last else n):
            mask[k] = 1
    return mask
