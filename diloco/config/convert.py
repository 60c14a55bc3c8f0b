"""Plain data (Hydra's output, YAML, JSON) <-> the frozen config dataclasses, rejecting unknown keys
and wrong types with the offending path named, and reading moved options' old keys (legacy.py)."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from diloco.config.legacy import upgraded
from diloco.config.schema import ConfigError


def from_dict(cls: type, raw: Any, path: str = "") -> Any:
    """Build dataclass `cls` from nested plain data, rejecting unknown keys and wrong types; an old
    key of a moved option (config/legacy.py) is read as its new one."""
    raw = upgraded(raw, path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {type(raw).__name__}: {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(
            f"unknown key(s) {', '.join(where + k for k in unknown)}; "
            f"{path or 'the top level'} accepts: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in raw.items():
        kwargs[name] = _coerce(hints[name], value, f"{path}.{name}" if path else name)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if str in inner and isinstance(value, str):  # a word beside a list (runtime.learner_batch=auto)
            return value
        return _coerce(inner[0], value, path)
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {value!r}")
        (item,) = typing.get_args(tp)[:1]
        return tuple(_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:  # a mapping of names to values (Ray resources): keys strings, values coerced
        key_tp, item = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        return {_coerce(key_tp, k, f"{path} key"): _coerce(item, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {value!r}")
        return value
    return value


def options_by_path(raw: dict, cls: type) -> dict[tuple[str, ...], Any]:
    """Plain config data of dataclass `cls` as {("runtime", "store", "url"): value}: its sections
    walked into, every other value (a mapping of Ray resources too) one option. How two configs are
    compared key by key (a resume, a learner joining a run)."""
    hints = typing.get_type_hints(cls)
    out: dict[tuple[str, ...], Any] = {}
    for name, value in raw.items():
        if dataclasses.is_dataclass(hints.get(name)) and isinstance(value, dict):
            out.update({(name, *path): v for path, v in options_by_path(value, hints[name]).items()})
        else:
            out[(name,)] = value
    return out


def to_dict(cfg: Any) -> dict:
    """Plain nested dict (lists for tuples), suitable for YAML/JSON."""
    return _plain(dataclasses.asdict(cfg))


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x
