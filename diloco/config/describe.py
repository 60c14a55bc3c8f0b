"""Every training option with its meaning and default, read from the dataclasses of schema.py (and
schema_runtime.py) and their comments (`scripts/train.py --describe`), and "did you mean" for a
mistyped key.

The comments in those files are the one description of each option: a comment on the field's line,
or the comment lines just above it, is its meaning, so the listing cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import io
import tokenize
from pathlib import Path
from typing import Any

from diloco.config import schema


def _section_files() -> list[Path]:
    """The files defining TrainConfig and its sections, in schema order: a section kept in a file of
    its own (schema_runtime.py) is read from there, with no list of files to keep in step."""
    def classes(obj: Any) -> list[type]:
        out = [type(obj)]
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                out += classes(value)
        return out

    return list(dict.fromkeys(Path(inspect.getsourcefile(c)) for c in classes(schema.TrainConfig())))


def _comments() -> dict[tuple[str, str], str]:
    """(class name, field name) -> the comment that documents it where the class is defined."""
    out: dict[tuple[str, str], str] = {}
    for path in _section_files():
        out.update(_file_comments(path.read_text()))
    return out


def _file_comments(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> its comment, for the classes of one source file."""
    out: dict[tuple[str, str], str] = {}
    cls, above = None, []
    lines = source.splitlines()
    inline = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            inline[tok.start[0]] = tok.string.lstrip("#").strip()
    for n, line in enumerate(lines, 1):
        stripped = line.strip()
        if line.startswith("class "):
            cls, above = line.split()[1].split("(")[0].rstrip(":"), []
        elif cls and stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
        elif cls and ":" in stripped and line.startswith("    ") and not line.startswith("     ") \
                and not stripped.startswith(('"""', "def ", "@")):
            name = stripped.split(":")[0].strip()
            doc = inline.get(n) if n in inline and not stripped.startswith("#") else None
            parts = ([" ".join(above)] if above else []) + ([doc] if doc else [])
            out[(cls, name)] = " ".join(parts)
            above = []
        elif not stripped:
            above = []
    return out


def options() -> list[tuple[str, Any, str]]:
    """(dotted key, default, meaning) of every option of TrainConfig, in schema order."""
    docs = _comments()

    def rows(obj: Any, prefix: str) -> list[tuple[str, Any, str]]:
        out = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):  # a nested section, finetune.lora
                out += rows(value, f"{prefix}{f.name}.")
            else:
                out.append((f"{prefix}{f.name}", value, docs.get((type(obj).__name__, f.name), "")))
        return out

    return rows(schema.TrainConfig(), "")


def sections() -> dict[str, str]:
    """Dotted key of each section (runtime, runtime.store, finetune.lora) -> its dataclass's
    docstring in one line: the heading `--describe` gives its options."""
    def walk(obj: Any, prefix: str) -> dict[str, str]:
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                out[prefix + f.name] = " ".join((type(value).__doc__ or "").split())
                out.update(walk(value, f"{prefix}{f.name}."))
        return out

    return walk(schema.TrainConfig(), "")


def describe(width: int = 100) -> str:
    """The listing `scripts/train.py --describe` prints: library defaults (configs/*.yaml presets
    override some; the resolved values of a run are in its config.yaml)."""
    import textwrap

    out = ["Options (key = library default: meaning). Presets in configs/ override some defaults;",
           "a run's resolved values are in <run>/config.yaml. Set any as key=value.", ""]
    section, nested = None, sections()
    for key, default, doc in options():
        head = key.rsplit(".", 1)[0] if "." in key else key  # runtime.store: a heading of its own
        if head != section:
            section = head
            out.append(textwrap.fill(f"[{head}] {nested.get(head, '')}".rstrip(), width, subsequent_indent="    "))
        line = f"  {key} = {default!r}"
        out.append(line if not doc else line + "\n" + textwrap.fill(
            doc, width, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(out)


def unknown_keys(overrides: list[str], groups: set[str]) -> list[str]:
    """An error line with close matches for each override naming no option (before Hydra's own
    "use +key" hint, which would add the typo as a new key). `groups`: config group names
    (model=tiny selects a preset, not an option)."""
    keys = [k for k, _, _ in options()]
    errors = []
    for arg in overrides:
        if "=" not in arg or arg.startswith(("hydra.", "~")):
            continue
        key = arg.split("=", 1)[0].lstrip("+")
        if key in keys or key in groups or key.startswith("hydra"):
            continue
        close = difflib.get_close_matches(key, keys, n=3, cutoff=0.75)
        if not close:  # a wrong section, right name: runtime.quorum -> syncer.quorum
            leaf = key.rsplit(".", 1)[-1]
            close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:3]
        hint = f"; did you mean {' or '.join(close)}?" if close else "; `--describe` lists every option"
        errors.append(f"unknown option {key!r}{hint}")
    return errors
