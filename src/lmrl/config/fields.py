"""Reading the schema: every key's dotted path, type and help; converting values to a type.

``schema()`` walks the ``Config`` dataclasses once and lists every dotted path (sections and
leaves) with its resolved type annotation and help text (``schema(SFTConfig)``: the same for
another root type). ``coerce`` turns a value parsed from YAML or the command line into a
field's type, or raises ``Mismatch`` saying what was expected.

The choice this module makes: conversion is strict where a mistake is likely and lenient
where YAML is: ``1e-6`` (a string to PyYAML) is a float, ``4.0`` is an int, a bare value
where a list is expected is a one-element list, and a number or word given for a string key
is kept as the text typed. Booleans never pass as numbers, and numbers never as booleans.
"""

from __future__ import annotations

import difflib
import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from lmrl.config.schema import Config


@dataclass(frozen=True)
class FieldSpec:
    """One key of the schema.

    Attributes:
        path: dotted path, e.g. ``actor.optim.lr``.
        type: the resolved annotation (a dataclass type for a section).
        help: the help text (a section's: its class docstring).
        section: True for a nested dataclass, False for a leaf value.
        items: for a key declared with ``options(Cls, ...)``, the dataclass declaring the
            names and types of its options; None otherwise.
    """

    path: str
    type: Any
    help: str
    section: bool
    items: type | None = None


@functools.cache
def schema(root: type = Config) -> dict[str, FieldSpec]:
    """Every dotted path of ``root`` (``Config`` by default), sections before their keys, in
    declaration order."""
    out: dict[str, FieldSpec] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = get_type_hints(cls)
        for f in fields(cls):
            path = f"{prefix}{f.name}"
            tp = hints[f.name]
            if is_dataclass(tp):
                doc = (tp.__doc__ or "").strip().splitlines()[0]
                out[path] = FieldSpec(path, tp, doc, section=True)
                walk(tp, path + ".")
            else:
                help, items = f.metadata.get("help", ""), f.metadata.get("items")
                out[path] = FieldSpec(path, tp, help, section=False, items=items)

    walk(root, "")
    return out


def leaf_paths(root: type = Config) -> list[str]:
    """The dotted paths of all leaf keys of ``root``."""
    return [p for p, spec in schema(root).items() if not spec.section]


def get_path(cfg: Any, path: str) -> Any:
    """The value at a dotted path of a config (``get_path(cfg, "actor.optim.lr")``), through
    the options of a key declared with ``options`` too (``"reward.overlap.chunks"``)."""
    for seg in path.split("."):
        cfg = cfg[seg] if isinstance(cfg, Mapping) else getattr(cfg, seg)
    return cfg


def set_path(cfg: Any, path: str, value: Any) -> None:
    """Set the value at a dotted path of a config, in place."""
    *parents, name = path.split(".")
    for seg in parents:
        cfg = getattr(cfg, seg)
    setattr(cfg, name, value)


def is_url(value: Any) -> bool:
    """An http(s) URL (``retriever.source``: a retrieval server rather than a file)."""
    return isinstance(value, str) and value.startswith(("http://", "https://"))


class Mismatch(Exception):
    """A value that does not fit a type; ``expected`` describes the type, ``hint`` may help."""

    def __init__(self, expected: str, hint: str = ""):
        super().__init__(expected)
        self.expected = expected
        self.hint = hint


def describe(tp: Any) -> str:
    """A short human description of a type annotation (``a number or null``)."""
    origin = get_origin(tp)
    if tp is Any:
        return "any value"
    if tp is type(None):
        return "null"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in get_args(tp))
    if origin is list:
        (item,) = get_args(tp)
        return f"a list ({describe(item)} each)"
    if origin is dict:
        return "a mapping"
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        text = " or ".join(describe(a) for a in args)
        return text + (" or null" if len(args) < len(get_args(tp)) else "")
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, raw: str | None = None) -> Any:
    """Convert ``value`` to the annotation ``tp``.

    Args:
        value: the value parsed from YAML (a file or a command-line ``key=value``).
        tp: a resolved type annotation from ``schema()``.
        raw: the text as typed on the command line, kept for string keys (``name=0.10``
            stays ``"0.10"``).
    Returns:
        The converted value.
    Raises:
        Mismatch: the value does not fit ``tp``.
    """
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise Mismatch(describe(tp))
        hint = ""
        for arm in args:
            if arm is type(None):
                continue
            try:
                return coerce(value, arm, raw)
            except Mismatch as err:
                hint = hint or err.hint
        raise Mismatch(describe(tp), hint)
    if value is None:
        raise Mismatch(describe(tp))
    if origin is Literal:
        choices = get_args(tp)
        text = raw if raw is not None and not isinstance(value, str) else value
        if isinstance(text, str) and text in choices:
            return text
        close = difflib.get_close_matches(str(text), [str(c) for c in choices], n=1)
        raise Mismatch(describe(tp), f"did you mean {close[0]!r}?" if close else "")
    if origin is list:
        (item,) = get_args(tp)
        if isinstance(value, list | tuple):
            out = []
            for v in value:
                try:
                    out.append(coerce(v, item))
                except Mismatch as err:
                    hint = f"; {err.hint}" if err.hint else ""
                    raise Mismatch(
                        describe(tp), f"item {v!r} is not {err.expected}{hint}"
                    ) from None
            return out
        if isinstance(value, Mapping):
            raise Mismatch(describe(tp))
        return [coerce(value, item, raw)]
    if origin is dict:
        if isinstance(value, Mapping):
            return dict(value)
        raise Mismatch(describe(tp))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise Mismatch(describe(tp))
    if tp is int:
        return _to_int(value)
    if tp is float:
        return _to_float(value)
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool | int | float):
            return raw if raw is not None else str(value)
        raise Mismatch(describe(tp))
    raise TypeError(f"the config schema uses an unsupported annotation {tp!r}")


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise Mismatch(describe(int))
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            try:
                value = float(value)
            except ValueError:
                raise Mismatch(describe(int)) from None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise Mismatch(describe(int))


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise Mismatch(describe(float))
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise Mismatch(describe(float)) from None
    raise Mismatch(describe(float))
