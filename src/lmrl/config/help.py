"""The help text of ``lmrl train --help``: every section and key, its default and its doc.

Generated from the schema (the dataclass docstrings and each field's ``help``), so it cannot
drift from the code; defaults are shown as YAML would write them, ``null = X`` defaults as
declared (they are resolved per run). The verl section prefixes come from the translation
table.
"""

from __future__ import annotations

import textwrap
import types
from collections.abc import Sequence
from dataclasses import fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from lmrl.config.errors import ConfigError
from lmrl.config.fields import get_path, schema
from lmrl.config.schema import Config
from lmrl.config.verl import section_prefixes


def format_help(sections: Sequence[str] | None = None, width: int = 100) -> str:
    """Sections and keys with their defaults, types and help text.

    Args:
        sections: top-level sections to show (``["actor", "critic"]``); None = all, followed
            by the verl key translation summary.
        width: wrap width of the help text.
    Returns:
        The text, ending with a newline.
    Raises:
        ConfigError: an unknown section.
    """
    spec = schema()
    tops = [p for p, s in spec.items() if s.section and "." not in p]
    if sections is not None:
        unknown = [s for s in sections if s not in tops]
        if unknown:
            raise ConfigError(f"unknown config section(s) {unknown}; sections: {', '.join(tops)}")
    lines = key_lines(Config, "lmrl train", "actor.optim.lr=1e-6", width, sections)
    if sections is None:
        lines += ["", "verl key paths are accepted and translated:"]
        pairs = section_prefixes()
        pad = max(len(v) for v, _ in pairs)
        lines += [f"  {v.ljust(pad)} -> {o}" for v, o in pairs]
        lines += [
            "  *_per_gpu micro-batch sizes, optim.warmup_style, trainer.n_gpus_per_node, ... -> "
            "their lmrl keys",
            "  keys of verl's GPU stack (FSDP, vLLM engine, dynamic batching...) are accepted "
            "with a one-line notice.",
        ]
    return "\n".join(lines) + "\n"


def rename_lines(pairs: Sequence[tuple[str, str]], title: str) -> list[str]:
    """A blank line, ``title``, then one aligned ``  theirs -> ours`` line per pair (the key
    translations that ``lmrl sft --help`` and ``lmrl train-flow --help`` list)."""
    pad = max((len(theirs) for theirs, _ in pairs), default=0)
    return ["", title, *(f"  {theirs.ljust(pad)} -> {ours}" for theirs, ours in pairs)]


def key_lines(
    root: type, command: str, example: str, width: int = 100, sections: Sequence[str] | None = None
) -> list[str]:
    """The usage header and every section and key of the ``root`` config with its default,
    type and help (``lmrl train --help``, ``lmrl sft --help``)."""
    defaults = root()
    lines = [
        f"Configuration: {command} [--config FILE.yaml] key=value ...",
        f"Keys are dotted paths ({example}); values are YAML (0.2, true, [a,b], null).",
        "Precedence: these defaults < the --config file < key=value overrides (later wins).",
    ]
    indent = " " * 6
    for path, s in schema(root).items():
        if sections is not None and path.split(".", 1)[0] not in sections:
            continue
        if s.section:
            if "." not in path:
                lines += ["", f"{path}: {s.help}"]
            else:
                lines += textwrap.wrap(
                    f"{path}: {s.help}", width, initial_indent="  ", subsequent_indent=indent
                )
            continue
        if s.items is None:
            lines.append(f"  {path} = {_yaml(get_path(defaults, path))}  ({_short(s.type)})")
        else:
            lines.append(f"  {path}  (mapping of the options below)")
        lines += textwrap.wrap(s.help, width, initial_indent=indent, subsequent_indent=indent)
        if s.items is not None:  # one key's options, each with its default, type and help
            hints, values = get_type_hints(s.items), get_path(defaults, path)
            for f in fields(s.items):
                text = (
                    f"{f.name} = {_yaml(values[f.name])}  ({_short(hints[f.name])}): "
                    f"{f.metadata['help']}"
                )
                lines += textwrap.wrap(text, width, initial_indent=indent + "- ",
                                       subsequent_indent=indent + "  ")  # fmt: skip
    return lines


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _short(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "|".join(str(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_short(a) for a in get_args(tp))
    if origin is list:
        return f"list[{_short(get_args(tp)[0])}]"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))
