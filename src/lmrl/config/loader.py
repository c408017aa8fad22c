"""Loading a config: defaults <- YAML file <- ``key=value`` overrides; saving the resolved one.

``load_config`` starts from the dataclass defaults, applies the YAML file (our layout or
verl's nesting, Hydra/OmegaConf ``${...}`` interpolations resolved within the file), then the
command-line overrides in order (later wins). Every key goes through the verl translation
table (``lmrl.config.verl``), is checked against the schema (unknown keys get a
did-you-mean), and its value is converted to the key's type. Two keys that land on one key of
ours with different values (verl's actor and critic ``param_dtype``, both lmrl's
``model.mixed_precision.param_dtype``) are one error naming both (``lmrl.config.setters``),
never a silent last-wins. Then the config is resolved (``null`` = "same as X" defaults filled
in) and validated (``lmrl.config.validate``). All problems found are raised together as one
``ConfigError``; nothing loads a model.

Notices (verl keys that change nothing here, keys the user set that change nothing given the
others, harmless oddities) go to the ``lmrl.config`` logger at WARNING level, one line each,
and to ``notices`` when a list is given. The loader remembers which keys the user set (a
key that changes nothing given the others gets its notice only then), and validation sees
the config as written, before derived defaults are filled, so its errors name only keys the
user set.

``validate_config(cfg)`` puts a ``Config`` built in code through the same steps: the keys that
differ from the defaults are loaded as if from a file, so values are converted to their types
in one place, here.

The same machinery loads another root config type (``lmrl sft``'s ``SFTConfig``): a
``ConfigKind`` names its root dataclass, its verl translation, and its resolve and validate
steps; ``load_config(..., kind=...)`` takes it, and ``RL_CONFIG`` (``Config``) is the default.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_origin, get_type_hints

import yaml

from lmrl.config.errors import ConfigError
from lmrl.config.fields import FieldSpec, Mismatch, coerce, leaf_paths, schema
from lmrl.config.fields import get_path as _get
from lmrl.config.fields import set_path as _set
from lmrl.config.schema import Config
from lmrl.config.setters import Setters
from lmrl.config.validate import check_config, inert_keys, resolve_config
from lmrl.config.verl import Translation, translate, verl_spellings

logger = logging.getLogger("lmrl.config")

#: keys ``load_config`` insists on by default (a training run needs both)
REQUIRED_FOR_TRAINING = ("model.path", "data.train_files")


@dataclass(frozen=True)
class ConfigKind:
    """What the loader needs to know about one root config type.

    Attributes:
        root: the root dataclass (``Config``, ``SFTConfig``).
        translate: ``translate(key, value) -> Translation``: ``lmrl.config.verl.translate``
            for its target schema (the one verl table's rules for this root).
        spellings: ``spellings(path) -> [verl spellings]`` for did-you-mean suggestions.
        resolve: ``resolve(cfg) -> cfg`` (derived defaults filled, on a copy).
        validate: ``validate(cfg, notices=list)`` on the config as written (before
            ``resolve``); raises ``ConfigError``.
        command: the command that loads it (named in help hints and saved files).
        inert: ``inert(cfg) -> {key: why}``: keys that change nothing given the others'
            values; each one the user set gets a notice.
    """

    root: type
    translate: Callable[[str, Any], Translation]
    spellings: Callable[[str], list[str]]
    resolve: Callable[[Any], Any]
    validate: Callable[..., None]
    command: str
    inert: Callable[[Any], Mapping[str, str]] = lambda cfg: {}


#: the RL training config (``lmrl train``)
RL_CONFIG = ConfigKind(
    Config, translate, verl_spellings, resolve_config, check_config, "lmrl train", inert_keys
)


@dataclass(frozen=True)
class _Entry:
    """One incoming ``key=value`` and where it came from."""

    key: str
    value: Any
    raw: str | None  # the text typed on the command line, None from a file
    source: str  # "on the command line" / "in FILE"


def load_config(
    config_file: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    required: Sequence[str] = REQUIRED_FOR_TRAINING,
    notices: list[str] | None = None,
    kind: ConfigKind = RL_CONFIG,
) -> Config:
    """Build the run's config from the defaults, a YAML file and command-line overrides.

    Args:
        config_file: a YAML file in our layout or verl's (``actor_rollout_ref: ...``), or
            None for the defaults alone.
        overrides: ``key=value`` strings, dotted keys in either layout; values are parsed as
            YAML (``0.2``, ``true``, ``[a,b]``, ``null``). A leading ``+`` (Hydra's "add") is
            accepted.
        required: dotted keys that must not be null (default: ``model.path`` and
            ``data.train_files``; pass ``()`` for a config that does not train).
        notices: if given, one-line notices are appended to it (they are logged regardless).
        kind: the root config type to build (default ``RL_CONFIG``: a ``Config``).
    Returns:
        The resolved, validated ``Config`` (an instance of ``kind.root``).
    Raises:
        ConfigError: every problem found (unreadable file, malformed override, unknown key,
            wrong type, unknown registry name, inconsistent batch sizes...), each naming the
            key and the fix.
    """
    layers: list[list[_Entry]] = []
    errors: list[str] = []
    if config_file is not None:
        layers.append(_flatten(_read_yaml(Path(config_file)), f"in {config_file}", kind))
    layer: list[_Entry] = []
    for text in overrides:
        try:
            layer.extend(parse_override(text, kind))
        except ConfigError as err:
            errors.extend(err.errors)
    layers.append(layer)
    return _finish(layers, errors, required, notices, kind)


def config_from_dict(
    data: Mapping[str, Any],
    overrides: Sequence[str] = (),
    *,
    required: Sequence[str] = (),
    notices: list[str] | None = None,
    kind: ConfigKind = RL_CONFIG,
) -> Config:
    """``load_config`` for a nested dict (our layout or verl's) instead of a file.

    Args:
        data: nested mapping, e.g. ``config_to_dict(cfg)`` or a parsed YAML document.
        overrides: ``key=value`` strings applied after ``data``.
        required: dotted keys that must not be null.
        notices: if given, notices are appended to it.
        kind: the root config type to build (default ``RL_CONFIG``).
    Returns:
        The resolved, validated ``Config`` (an instance of ``kind.root``).
    Raises:
        ConfigError: as ``load_config``.
    """
    errors: list[str] = []
    layer: list[_Entry] = []
    for text in overrides:
        try:
            layer.extend(parse_override(text, kind))
        except ConfigError as err:
            errors.extend(err.errors)
    layers = [_flatten(data, "in the given dict", kind), layer]
    return _finish(layers, errors, required, notices, kind)


def validate_config(cfg: Config, *, notices: list[str] | None = None) -> Config:
    """Check a config built or edited in code, as ``load_config`` checks a file.

    The keys whose values differ from the defaults go through the loader as if written in a
    file: converted to their types (``"0.3"`` -> 0.3; a value that does not fit is an error),
    checked by ``check_config``, and resolved.

    Args:
        cfg: the config as written. A key that is null here and that resolving fills from
            another key is checked through that key and never named; a resolved config is
            checked too, naming every key.
        notices: if given, notices and warnings (allowed but probably unintended settings)
            are appended to it; they are logged to ``lmrl.config`` either way.
    Returns:
        The resolved config (as ``load_config`` returns it).
    Raises:
        ConfigError: every problem found, each naming the key and the fix.
    """
    defaults = Config()
    changed: dict = {}
    for path, spec in schema().items():
        value = _get(cfg, path)
        if not spec.section and value != _get(defaults, path):
            *parents, name = path.split(".")
            node = changed
            for seg in parents:
                node = node.setdefault(seg, {})
            node[name] = value
    return config_from_dict(changed, notices=notices)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as nested plain dicts and lists (YAML- and JSON-serializable)."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path, command: str = "lmrl train") -> Path:
    """Write the config as YAML (atomically: a temp file, then a rename).

    Args:
        cfg: the config, normally the resolved one ``load_config`` returned.
        path: the file to write; parent directories are created.
        command: the command named in the file's header comment.
    Returns:
        The path written. ``load_config(path, [])`` gives back an equal config.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = f"# lmrl resolved config: load it with `{command} --config THIS_FILE`\n"
    text += yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)
    fd, tmp = tempfile.mkstemp(prefix=".config-", suffix=".yaml", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def parse_override(text: str, kind: ConfigKind = RL_CONFIG) -> list[_Entry]:
    """Split one command-line ``key=value`` (a mapping value gives several entries).

    Raises:
        ConfigError: no ``=``, an empty key or key segment, or a ``~key`` deletion.
    """
    if text.strip().startswith("~"):
        raise ConfigError(
            f"override {text!r}: deleting keys (~key) is not supported; set key=null instead"
        )
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value; write e.g. actor.clip_ratio=0.2")
    key, raw = text.split("=", 1)
    key = key.strip()
    key = key.lstrip("+")
    if not key or any(not seg for seg in key.split(".")):
        raise ConfigError(f"override {text!r}: {key!r} is not a dotted key like actor.clip_ratio")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    if not _is_plain(value):
        value = raw
    return _expand(key, value, "on the command line", kind, raw)


# ------------------------------------------------------------------------------------------
# internals
# ------------------------------------------------------------------------------------------


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str):
        return True
    if isinstance(value, list | tuple):
        return all(_is_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def _plain(value: Any) -> Any:
    """YAML scalars PyYAML turns into objects (dates) become their text."""
    if isinstance(value, datetime.date | datetime.datetime):
        return value.isoformat()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _read_yaml(path: Path) -> Mapping[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as err:
        raise ConfigError(f"config file {path} cannot be read: {err}") from None
    try:
        _refuse_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), path)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {yaml_problem(err)}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections (data:, actor:, ...), "
            f"got a {type(data).__name__}"
        )
    data = _plain(data)
    if "${" in text:
        data = _resolve_interpolations(data, path)
    return data


def _refuse_duplicate_keys(node: yaml.Node | None, path: Path, prefix: str = "") -> None:
    """Refuse a key written twice in one mapping (PyYAML silently keeps the last), e.g. two
    ``actor:`` sections, naming the dotted key and both lines."""
    if isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item, path, prefix)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
            key, line = f"{prefix}{key_node.value}", key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(
                    f"config file {path}: {key!r} is written twice (lines {seen[key]} and "
                    f"{line}); YAML would keep only the second, so merge them into one"
                )
            seen[key] = line
            _refuse_duplicate_keys(value_node, path, f"{key}.")
        else:
            _refuse_duplicate_keys(value_node, path, prefix)


def _resolve_interpolations(data: Mapping[str, Any], path: Path) -> Mapping[str, Any]:
    """Resolve OmegaConf ``${...}`` interpolations within the file (verl's YAML uses them)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(OmegaConf.create(data), resolve=True)
    except OmegaConfBaseException as err:
        first_line = str(err).splitlines()[0]
        raise ConfigError(
            f"config file {path}: cannot resolve an interpolation ({first_line}); "
            "write the value itself instead"
        ) from None


def _flatten(data: Mapping[str, Any], source: str, kind: ConfigKind) -> list[_Entry]:
    """A nested mapping -> leaf entries."""
    out: list[_Entry] = []
    for k, v in data.items():
        out.extend(_expand(str(k), v, source, kind))
    return out


def _expand(
    key: str, value: Any, source: str, kind: ConfigKind, raw: str | None = None
) -> list[_Entry]:
    """One key -> leaf entries, descending into mappings until a schema key takes a mapping."""
    if not isinstance(value, Mapping):
        return [_Entry(key, value, raw, source)]
    target = kind.translate(key, value).path
    spec = schema(kind.root).get(target) if target is not None else None
    if spec is not None and not spec.section and spec.items is None:  # e.g. reward_kwargs
        return [_Entry(key, dict(value), raw, source)]
    out: list[_Entry] = []
    for k, v in value.items():
        out.extend(_expand(f"{key}.{k}", v, source, kind))
    return out


def _finish(
    layers: list[list[_Entry]],
    errors: list[str],
    required: Iterable[str],
    notices: list[str] | None,
    kind: ConfigKind,
) -> Config:
    found: list[str] = []
    written: dict[str, tuple[_Entry, Any]] = {}  # path -> the entry that set it last, its value
    cfg = _build(layers, errors, found, kind, written)
    defaults = kind.root()
    for path, why in kind.inert(cfg).items():
        if path in written:
            entry, value = written[path]
            if entry.raw is None and _lookup(cfg, path) == _lookup(defaults, path):
                continue  # a file's default (a saved or a full verl config writes every key)
            found.append(f"{entry.key}={value!r} changes nothing: {why} ({entry.source})")
    if errors:
        _emit(found, notices)
        raise ConfigError(errors)
    missing = []
    for path in required:
        if _get(cfg, path) is None:
            verl = kind.spellings(path)
            alias = f" (verl: {verl[0]}=...)" if verl else ""
            missing.append(
                f"{path} is not set: give {path}=...{alias} on the command line or in the "
                "config file"
            )
    try:
        kind.validate(cfg, notices=found)  # as written: errors name only keys the user set
        cfg = kind.resolve(cfg)
    except ConfigError as err:
        _emit(found, notices)
        raise ConfigError(missing + err.errors) from None
    _emit(found, notices)
    if missing:
        raise ConfigError(missing)
    return cfg


def _lookup(cfg: Any, path: str) -> Any:
    """The value at a dotted path, through mapping keys too (``rollout.vllm.dtype``)."""
    for seg in path.split("."):
        cfg = cfg.get(seg) if isinstance(cfg, Mapping) else getattr(cfg, seg, None)
    return cfg


def _build(
    layers: list[list[_Entry]],
    errors: list[str],
    found: list[str],
    kind: ConfigKind,
    written: dict[str, tuple[_Entry, Any]],
) -> Config:
    cfg = kind.root()
    spec = schema(kind.root)
    deferred: list[tuple[str, _Entry, Any]] = []  # (path, entry, value) of Translation.also
    setters = Setters(kind.spellings)
    for number, layer in enumerate(layers):
        for entry in layer:
            tr = kind.translate(entry.key, entry.value)
            where = f" ({entry.source})"
            if tr.error:
                errors.append(tr.error + where)
                continue
            if tr.notice:
                found.append(tr.notice + where)
                continue
            path = tr.path
            mapped = f" (lmrl key {path!r})" if path != entry.key else ""
            if path not in spec:
                holder = _mapping_holder(path, kind.root)
                if holder is not None and spec[holder].items is not None:
                    error = _set_option(cfg, spec[holder], path, entry, tr.value)
                    if error:
                        errors.append(error + where)
                    elif error := setters.conflict(path, entry, _lookup(cfg, path), number):
                        errors.append(error)
                    else:
                        written[path] = (entry, tr.value)
                    continue
                if holder is not None:  # reward_kwargs.scale=2: one item of a mapping key
                    _set(cfg, holder, _with_item(_get(cfg, holder), path[len(holder) + 1 :],
                                                 tr.value))  # fmt: skip
                    continue
                errors.append(_unknown_key(entry, path, kind) + where)
                continue
            if spec[path].section:
                if tr.value is None:  # an empty section in YAML (`critic:`) sets nothing
                    continue
                first = next(p for p in leaf_paths(kind.root) if p.startswith(path + "."))
                errors.append(
                    f"{entry.key}{mapped} is a section, not a value; set its keys, "
                    f"e.g. {first}=...{where}"
                )
                continue
            if tr.value == "???":
                errors.append(
                    f"{entry.key}{mapped} is ??? (a value verl's YAML leaves to the user); "
                    f"give it a value{where}"
                )
                continue
            raw = entry.raw if tr.value is entry.value else None
            given = tr.value if tr.update is None else tr.update(_get(cfg, path))
            try:
                value = coerce(given, spec[path].type, raw)
            except Mismatch as err:
                hint = f"; {err.hint}" if err.hint else ""
                if spec[path].items is not None:  # reward.overlap=rows: name its options
                    names = ", ".join(get_type_hints(spec[path].items))
                    hint += f"; its options are {names} (set one as {path}.NAME=...)"
                errors.append(
                    f"{entry.key}{mapped}: expected {err.expected}, got {tr.value!r}{hint}{where}"
                )
                continue
            if tr.update is None and setters.ignores(path, entry, value):
                continue
            if tr.update is None and (error := setters.conflict(path, entry, value, number)):
                errors.append(error)
                continue
            # a notice quotes what the user wrote (param_offload=true, not offload='params')
            written[path] = (entry, value if tr.update is None else entry.value)
            _set(cfg, path, value)
            deferred += [(other, entry, tr.value) for other in tr.also]
    for path, entry, given in deferred:  # Translation.also: where no key set the path itself
        if path not in written:
            written[path] = (entry, given)
            _set(cfg, path, coerce(given, spec[path].type, entry.raw))
    return cfg


def _with_item(mapping: Mapping, key: str, value: Any) -> dict:
    """A copy of ``mapping`` with ``key`` set; a dotted key (``add.binary``) nests."""
    out = dict(mapping)
    head, _, rest = key.partition(".")
    if rest:
        inner = out.get(head)
        out[head] = _with_item(inner if isinstance(inner, Mapping) else {}, rest, value)
    else:
        out[head] = value
    return out


def _set_option(cfg: Any, spec: FieldSpec, path: str, entry: _Entry, value: Any) -> str | None:
    """Set one option of a key declared with ``options`` (``rollout.vllm.enforce_eager``),
    converted to its declared type; the error message when the name or the value is wrong."""
    name = path[len(spec.path) + 1 :]
    mapped = f" (lmrl key {path!r})" if path != entry.key else ""
    types_ = get_type_hints(spec.items)
    if name not in types_:
        close = difflib.get_close_matches(name, list(types_), n=1)
        hint = f"did you mean {spec.path}.{close[0]}? " if close else ""
        return (
            f"unknown key {entry.key!r}{mapped}; {hint}the options of {spec.path} are: "
            + ", ".join(types_)
        )
    raw = entry.raw if value is entry.value else None
    try:
        converted = coerce(value, types_[name], raw)
    except Mismatch as err:
        hint = f"; {err.hint}" if err.hint else ""
        return f"{entry.key}{mapped}: expected {err.expected}, got {value!r}{hint}"
    _set(cfg, spec.path, {**_get(cfg, spec.path), name: converted})
    return None


def _mapping_holder(path: str, root: type) -> str | None:
    """The mapping-valued schema key that ``path`` lies inside, if any."""
    spec = schema(root)
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in spec:
            return prefix if get_origin(spec[prefix].type) is dict else None
    return None


def _unknown_key(entry: _Entry, path: str, kind: ConfigKind) -> str:
    mapped = f" (lmrl key {path!r})" if path != entry.key else ""
    leaves = leaf_paths(kind.root)
    candidates = list(leaves)
    for leaf in leaves:
        candidates.extend(kind.spellings(leaf))
    close = difflib.get_close_matches(path, candidates, n=1, cutoff=0.6)
    if not close and path != entry.key:
        close = difflib.get_close_matches(entry.key, candidates, n=1, cutoff=0.6)
    if close:
        return f"unknown key {entry.key!r}{mapped}; did you mean {close[0]!r}?"
    section = path.rsplit(".", 1)[0] if "." in path else ""
    spec = schema(kind.root)
    if section in spec and spec[section].section:
        keys = [p.rsplit(".", 1)[1] for p in leaves if p.rsplit(".", 1)[0] == section]
        return f"unknown key {entry.key!r}{mapped}; the keys of {section} are: {', '.join(keys)}"
    return f"unknown key {entry.key!r}{mapped}; `{kind.command} --help` lists every key"


def _emit(found: list[str], notices: list[str] | None) -> None:
    for line in found:
        logger.warning(line)
    if notices is not None:
        notices.extend(found)


def yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line: ``line L, column C: what`` (PyYAML's own message spans six)."""
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    what = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{where}{what}"
