"""examples/*.yaml: every file loads, and every setting it writes lands in the loaded config.

Each leaf of a file (``actor.optim.lr: 1.0e-6``, or verl's ``actor_rollout_ref.actor.clip_ratio``)
goes through the verl translation table to the path it sets in ``Config``, and the loaded
config must hold the file's value there. A verl key that changes nothing here must have its
notice. A key the loader dropped on the way fails the test, naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmrl.config import Config, load_config
from lmrl.config.fields import Mismatch, coerce, get_path, schema
from lmrl.config.verl import translate

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def workspace(tiny_workspace) -> Path:
    """A tiny model and the digits task, so that the examples load against real paths."""
    return tiny_workspace


def _paths(root: Path) -> list[str]:
    return [f"model.path={root / 'model'}", f"data.train_files={root / 'data' / 'train.parquet'}"]


def leaves(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key as written, value)`` for every leaf of a YAML document.

    A mapping stops the descent where the schema takes a whole mapping as one value
    (``reward.reward_kwargs``), as the loader does; a key of named options
    (``actor.policy_loss``) is set one option at a time, so the descent goes on into it.
    """
    spec = schema(Config)
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        target = translate(dotted, value).path if isinstance(value, Mapping) else None
        takes_mapping = target in spec and not spec[target].section and spec[target].items is None
        if isinstance(value, Mapping) and value and not takes_mapping:
            yield from leaves(value, dotted + ".")
        else:
            yield dotted, value


def _same(expected: Any, actual: Any) -> bool:
    if isinstance(expected, float) and isinstance(actual, float):
        return math.isclose(expected, actual, rel_tol=1e-12, abs_tol=0.0)
    if isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        return len(expected) == len(actual) and all(map(_same, expected, actual))
    return type(expected) is type(actual) and expected == actual


def unapplied(data: Mapping[str, Any], cfg: Config, notices: Sequence[str]) -> list[str]:
    """The settings of a YAML document that did not land in ``cfg``, one line each.

    Args:
        data: the parsed YAML document (our layout or verl's).
        cfg: the config loaded from it.
        notices: the loader's notices for that load (a key that changes nothing here must
            have one).

    Returns:
        ``key: why`` for each leaf whose value is not at its translated path (or, for a key
        that changes nothing, that has no notice); empty when everything landed.
    """
    spec = schema(Config)
    out = []
    for key, value in leaves(data):
        tr = translate(key, value)
        if tr.error:
            out.append(f"{key}: refused by the verl table ({tr.error})")
        elif tr.path is None:
            if not any(n.startswith(f"{key}=") for n in notices):
                out.append(f"{key}={value!r}: changes nothing here, yet no notice says so")
        elif tr.path not in spec and not _is_option(tr.path, spec):
            out.append(f"{key}: translates to {tr.path!r}, which is not a key of Config")
        elif tr.path not in spec:  # one option of a mapping key (rollout.vllm.enforce_eager)
            holder, name = tr.path.rsplit(".", 1)
            actual = get_path(cfg, holder)[name]
            if not _same(tr.value, actual):
                where = f" (as {tr.path})" if tr.path != key else ""
                out.append(f"{key}{where}: the file says {tr.value!r}, the config holds {actual!r}")
        elif tr.update is not None:  # one verl switch of several folded into one key
            if not _same(tr.update(get_path(cfg, tr.path)), get_path(cfg, tr.path)):
                out.append(f"{key} (as {tr.path}): {get_path(cfg, tr.path)!r} ignores it")
        else:
            try:
                expected = coerce(tr.value, spec[tr.path].type)
            except Mismatch:
                expected = tr.value
            actual = get_path(cfg, tr.path)
            if not _same(expected, actual):
                where = f" (as {tr.path})" if tr.path != key else ""
                out.append(f"{key}{where}: the file says {expected!r}, the config holds {actual!r}")
    return out


def _is_option(path: str, spec) -> bool:
    """``path`` names one option of a key declared with ``options`` (``rollout.vllm.dtype``)."""
    holder, name = path.rsplit(".", 1) if "." in path else ("", path)
    items = spec[holder].items if holder in spec else None
    return items is not None and name in {f.name for f in dataclasses.fields(items)}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_setting_of_an_example_lands(workspace, path):
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    notices: list[str] = []
    cfg = load_config(path, _paths(workspace), notices=notices)
    assert list(leaves(data)), f"{path.name} sets nothing"
    missed = unapplied(data, cfg, notices)
    assert not missed, f"{path.name}: settings that did not land:\n" + "\n".join(missed)


def test_examples_cover_the_recipes():
    assert {p.stem for p in EXAMPLES} >= {
        "grpo", "ppo", "dapo", "gspo", "dr_grpo", "reinforce_pp", "rloo", "lora"
    }  # fmt: skip


# ---------------------------------------------------------------------- the check itself
SYNTHETIC = """\
data:
  train_batch_size: 8
actor_rollout_ref:
  actor:
    ppo_mini_batch_size: 4
    ppo_micro_batch_size_per_gpu: 2
    clip_ratio_high: 0.31
  rollout:
    n: 2
    max_num_seqs: 64
algorithm:
  adv_estimator: grpo
  kl_ctrl:
    kl_coef: 0.002
"""


def test_leaves_walk_the_file():
    data = yaml.safe_load(SYNTHETIC)
    keys = [key for key, _ in leaves(data)]
    assert keys == [
        "data.train_batch_size",
        "actor_rollout_ref.actor.ppo_mini_batch_size",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.actor.clip_ratio_high",
        "actor_rollout_ref.rollout.n",
        "actor_rollout_ref.rollout.max_num_seqs",
        "algorithm.adv_estimator",
        "algorithm.kl_ctrl.kl_coef",
    ]


def test_a_silently_dropped_key_is_caught(workspace, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(SYNTHETIC, encoding="utf-8")
    data = yaml.safe_load(SYNTHETIC)
    notices: list[str] = []
    cfg = load_config(path, _paths(workspace), notices=notices)
    assert unapplied(data, cfg, notices) == []

    # The same file checked against a load that dropped it (the defaults), and against a
    # load that lost its notices: every setting is named.
    defaults = load_config(None, _paths(workspace))
    missed = unapplied(data, defaults, notices)
    assert [line.split(":")[0] for line in missed] == [
        "data.train_batch_size",
        "actor_rollout_ref.actor.ppo_mini_batch_size (as actor.ppo_mini_batch_size)",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (as actor.ppo_micro_batch_size)",
        "actor_rollout_ref.actor.clip_ratio_high (as actor.clip_ratio_high)",
        "actor_rollout_ref.rollout.n (as rollout.n)",
        "algorithm.adv_estimator",
        "algorithm.kl_ctrl.kl_coef",
    ]
    assert unapplied(data, cfg, []) == [
        "actor_rollout_ref.rollout.max_num_seqs=64: changes nothing here, yet no notice says so"
    ]


def test_a_value_changed_on_the_way_is_caught(workspace):
    data = {"actor": {"optim": {"lr": 1.0e-6}}, "rollout": {"n": 2}}
    cfg = load_config(None, [*_paths(workspace), "actor.optim.lr=2e-6", "rollout.n=2"])
    assert unapplied(data, cfg, []) == [
        "actor.optim.lr: the file says 1e-06, the config holds 2e-06"
    ]


def test_a_key_the_config_does_not_have_is_caught():
    assert unapplied({"actor": {"clip_ratio_hgh": 0.3}}, Config(), []) == [
        "actor.clip_ratio_hgh: translates to 'actor.clip_ratio_hgh', which is not a key of Config"
    ]


FLOW_EXAMPLES = sorted((Path(__file__).parents[1] / "examples" / "flow").glob("*.yaml"))


@pytest.mark.parametrize("path", FLOW_EXAMPLES, ids=[p.stem for p in FLOW_EXAMPLES])
def test_every_setting_of_a_flow_example_lands(path, tmp_path):
    from lmrl.config.flow import FlowConfig, load_flow_config

    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    cfg = load_flow_config(path, [f"model.path={tmp_path}", f"data.train_files={tmp_path}"])
    spec = schema(FlowConfig)
    missed = []
    for key, value in leaves_of(data):
        expected = coerce(value, spec[key].type) if key in spec else value
        if key not in spec or not _same(expected, get_path(cfg, key)):
            missed.append(key)
    assert FLOW_EXAMPLES and not missed, f"{path.name}: settings that did not land: {missed}"


def leaves_of(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` for every leaf of a YAML document (no verl translation)."""
    for key, value in data.items():
        if isinstance(value, Mapping):
            yield from leaves_of(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value
