"""Resolving and validating a config, before anything loads a model.

``resolve_config`` fills the defaults that are "the same as another key" (``critic.enable``
from the estimator, the critic's batch sizes and model from the actor's, the run directory
from the project and experiment names), so the trainer reads final values and never
re-derives them; values already have their types (the loader converts them, one key at a
time, and is the only place that does). ``check_config`` then checks what a single key's type
cannot, with the checks of ``lmrl.config.checks``: registry names (taken lazily from
``lmrl.algos``), ranges, batch sizes that must divide each other, and combinations that cannot
work. ``lmrl.config.loader.validate_config`` does all of it for a ``Config`` built in code.
Every problem becomes one message naming the key and the fix; all of them are raised together
as a ``ConfigError``.

Choices made here:

- What an estimator needs comes from its registry entry (``needs``), never from a list of
  names here: ``values`` means a critic (``critic.enable`` null resolves to on), ``index``
  means a group baseline.
- A group-baseline estimator (``index``: grpo, rloo, grpo_passk, opo,
  reinforce_plus_plus_baseline) with ``rollout.n == 1`` is an **error**: every group then has
  one response, there is no baseline, and the run silently degrades to REINFORCE.
- ``algorithm.filter_groups.enable`` with ``rollout.n == 1`` is an error too (every group has
  zero spread, so every group would be dropped).
- ``algorithm.kl_ctrl`` keeps verl's defaults (``target_kl=0.1``, ``horizon=10000``);
  ``type=adaptive`` with either set to null or <= 0 is an error.
- A critic enabled for a critic-free estimator is allowed (a notice: it is trained but its
  values are unused), as in verl.
- Errors name only keys the user set: a key ``resolve_config`` fills from another one
  (``critic.ppo_epochs`` from ``actor.ppo_epochs``, ``data.gen_batch_size`` from
  ``data.train_batch_size``) is checked through its source and never named itself.
- What cannot run here is refused now, not after a model loads: ``trainer.backend=ray``
  without Ray installed and ``rollout.name=vllm`` without vLLM installed.
- Keys that change nothing given the others (``actor.kl_loss_coef`` while
  ``actor.use_kl_loss=false``) are listed by ``inert_keys``; the loader gives a one-line
  notice for each one the user set, in the words of the verl notices. A few are errors
  instead (``Findings.unused``: a value other than the default that nothing would read):
  ``trainer.rollback_lr_factor`` with ``trainer.max_rollbacks=0``,
  ``rollout.multi_turn.format`` with multi-turn off.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os

from lmrl.config.async_training import log_prob_mode
from lmrl.config.checks import CHECKS, Findings, estimator_needs
from lmrl.config.errors import ConfigError
from lmrl.config.fields import get_path as _get
from lmrl.config.fields import schema
from lmrl.config.fields import set_path as _set
from lmrl.config.schema import Config

logger = logging.getLogger("lmrl.config")


def resolve_config(cfg: Config) -> Config:
    """A copy of ``cfg`` with every value converted to its type and derived defaults filled.

    Filled when null: ``critic.enable`` (on for estimators that need values),
    ``critic.model.path`` (the actor's),
    ``critic.ppo_epochs / ppo_mini_batch_size / shuffle / loss_agg_mode`` (the actor's),
    ``ref.log_prob_micro_batch_size`` (the rollout's), ``rollout.log_prob_mode``
    (``lmrl.config.async_training.log_prob_mode``), ``data.seed`` (``trainer.seed``),
    ``data.gen_batch_size`` (``data.train_batch_size``), ``trainer.default_local_dir``
    (``checkpoints/<project_name>/<experiment_name>``); options a key declared with ``options``
    (``rollout.vllm``) leaves out take their defaults. A leading ``~`` in paths is expanded.
    Idempotent.

    Args:
        cfg: a config whose values have their keys' types, as the loader builds it (the one
            place values are converted). A ``Config()`` edited in code is converted, checked
            and resolved by ``validate_config(cfg)`` or
            ``config_from_dict(config_to_dict(cfg))``.
    Returns:
        The resolved copy; ``cfg`` itself is not modified.
    """
    cfg = copy.deepcopy(cfg)
    actor, critic, data = cfg.actor, cfg.critic, cfg.data
    if critic.enable is None:
        critic.enable = "values" in (estimator_needs(cfg.algorithm.adv_estimator) or ())
    if critic.model.path is None:
        critic.model.path = cfg.model.path
    if critic.ppo_epochs is None:
        critic.ppo_epochs = actor.ppo_epochs
    if critic.ppo_mini_batch_size is None:
        critic.ppo_mini_batch_size = actor.ppo_mini_batch_size
    if critic.shuffle is None:
        critic.shuffle = actor.shuffle
    if critic.loss_agg_mode is None:
        critic.loss_agg_mode = actor.loss_agg_mode
    if cfg.ref.log_prob_micro_batch_size is None:
        cfg.ref.log_prob_micro_batch_size = cfg.rollout.log_prob_micro_batch_size
    if data.gen_batch_size is None:
        data.gen_batch_size = data.train_batch_size
    if cfg.rollout.log_prob_mode is None:
        cfg.rollout.log_prob_mode = log_prob_mode(cfg)
    for path, spec in schema().items():  # options set in code may leave some out
        if spec.items is not None:
            _set(cfg, path, {**dataclasses.asdict(spec.items()), **_get(cfg, path)})
    resolve_run_paths(cfg)
    critic.model.path = expand_user(critic.model.path)
    cfg.reward.custom_reward_function.path = expand_user(cfg.reward.custom_reward_function.path)
    return cfg


def expand_user(path: str | list[str] | None) -> str | list[str] | None:
    """``~`` expanded in a path or a list of paths (None stays None)."""
    if isinstance(path, list):
        return [os.path.expanduser(p) for p in path]
    return os.path.expanduser(path) if path is not None else None


def range_errors(cfg, checks) -> list[str]:
    """``"key=value message"`` for each ``(key, ok, message)`` of ``checks`` whose value fails
    ``ok`` (NaN fails every range): the range checks of ``lmrl sft`` and ``lmrl train-flow``."""
    errors = []
    for key, ok, message in checks:
        value = _get(cfg, key)
        if not ok(value):
            errors.append(f"{key}={value!r} {message}")
    return errors


def resolve_run_paths(cfg) -> None:
    """What ``lmrl train``, ``lmrl sft`` and ``lmrl train-flow`` resolve alike: ``data.seed``
    (= trainer.seed), the run directory (``checkpoints/<project>/<experiment>``), and ``~`` in
    paths (``trainer.resume_mode`` included)."""
    data, trainer = cfg.data, cfg.trainer
    if data.seed is None:
        data.seed = trainer.seed
    if trainer.default_local_dir is None:
        trainer.default_local_dir = os.path.join(
            "checkpoints", trainer.project_name, trainer.experiment_name
        )
    cfg.model.path = expand_user(cfg.model.path)
    data.train_files = expand_user(data.train_files)
    data.val_files = expand_user(data.val_files)
    trainer.default_local_dir = expand_user(trainer.default_local_dir)
    if trainer.resume_mode.startswith("~"):
        trainer.resume_mode = os.path.expanduser(trainer.resume_mode)


def check_config(cfg: Config, *, notices: list[str] | None = None) -> None:
    """Check a config whose values have their types for everything a key's type cannot catch
    (the loader's validation step; ``validate_config`` for a config edited in code).

    Args:
        cfg: the config as written (the loader passes it before ``resolve_config``): a key
            that is null here and that resolving fills from another key is checked through
            that key and never named. A resolved config is checked too, naming every key.
        notices: if given, warnings (allowed but probably unintended settings) are appended
            to it; otherwise they are logged to ``lmrl.config``.
    Raises:
        ConfigError: every problem found, each naming the key and the fix.
    """
    resolved = resolve_config(cfg)
    derived = frozenset(
        path
        for path, spec in schema().items()
        if not spec.section and _get(cfg, path) is None and _get(resolved, path) is not None
    )
    v = Findings(resolved, derived)
    for check in CHECKS:
        check(resolved, v)
    if notices is None:
        for line in v.warnings:
            logger.warning(line)
    else:
        notices.extend(v.warnings)
    if v.errors:
        raise ConfigError(v.errors)


def inert_keys(cfg: Config) -> dict[str, str]:
    """The keys that change nothing given the others' values, each with the reason.

    The loader gives a notice for each one the user set (``actor.kl_loss_coef=0.01`` while
    ``actor.use_kl_loss=false`` is verl's classic slip: the KL loss stays off).

    Args:
        cfg: a config (resolved or not).
    Returns:
        ``{dotted key: why it changes nothing}``.
    """
    out = {}
    if not cfg.actor.use_kl_loss:
        why = "actor.use_kl_loss=false, so there is no KL loss; set actor.use_kl_loss=true"
        out.update(dict.fromkeys(["actor.kl_loss_coef", "actor.kl_loss_type"], why))
    if not cfg.algorithm.use_kl_in_reward:
        why = (
            "algorithm.use_kl_in_reward=false, so the reward has no KL penalty; set "
            "algorithm.use_kl_in_reward=true"
        )
        keys = [
            "kl_penalty",
            "kl_ctrl.type",
            "kl_ctrl.kl_coef",
            "kl_ctrl.target_kl",
            "kl_ctrl.horizon",
        ]
        out.update(dict.fromkeys([f"algorithm.{k}" for k in keys], why))
    out.update(_inert_placement(cfg))
    a = cfg.async_training
    if not a.enable:
        why = "async_training.enable=false, so nothing is generated ahead; set it to true"
        keys = ["staleness_threshold", "trigger_parameter_sync_step", "partial_rollout"]
        out.update(dict.fromkeys([f"async_training.{k}" for k in keys], why))
    if not (a.enable and cfg.trainer.backend == "ray"):
        out["resources.rollout_workers"] = (
            "only an async run on Ray has a rollout group; set async_training.enable=true "
            "and trainer.backend=ray"
        )
    if cfg.rollout.name != "vllm":
        why = f"rollout.name={cfg.rollout.name}, so no vLLM engine runs; set rollout.name=vllm"
        out.update({f"rollout.vllm.{k}": why for k in cfg.rollout.vllm})
    mt = cfg.rollout.multi_turn
    if not (mt.enable and "search" in mt.tools):
        why = (
            "rollout.multi_turn.enable=false, so no tool runs"
            if not mt.enable
            else f"rollout.multi_turn.tools={mt.tools} has no search tool"
        )
        out.update({f"retriever.{f.name}": why for f in dataclasses.fields(cfg.retriever)})
    return out


def _inert_placement(cfg: Config) -> dict[str, str]:
    """``actor/critic.strategy`` and ``.offload``: only Ray's FSDP2 workers read them."""
    out = {}
    for section in ("actor", "critic"):
        if cfg.trainer.backend == "local":
            why = (
                "trainer.backend=local trains in one process, without data parallelism or "
                "sharding; set trainer.backend=ray"
            )
            out.update(dict.fromkeys([f"{section}.strategy", f"{section}.offload"], why))
        elif getattr(cfg, section).strategy != "fsdp2":
            why = f"only fsdp2 offloads shards; set {section}.strategy=fsdp2"
            out[f"{section}.offload"] = why
    return out
