"""The checks ``validate_config`` runs on a resolved config, one function per concern.

Each ``check_*(cfg, findings)`` appends to ``findings.errors`` (the run cannot start) and
``findings.warnings`` (allowed but probably unintended); ``CHECKS`` lists them in the order
they run. A key that resolving filled from another key (``findings.derived``) is checked
through its source, so an error names what the user wrote. Registries are imported only when
a check needs them (``import lmrl.config`` imports no torch).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any

from lmrl.config import names as builtin
from lmrl.config.async_training import check_async
from lmrl.config.curriculum import check_curriculum
from lmrl.config.errors import ConfigError
from lmrl.config.fields import get_path as _get
from lmrl.config.mixture import parse_mixture
from lmrl.config.rollout_checks import check_rollout
from lmrl.config.run import RUN_CHECKS
from lmrl.config.schema import Config


class Findings:
    """Errors and warnings about one resolved config.

    Attributes:
        cfg: the resolved config.
        derived: keys that resolving filled from another key; their range checks are left
            to their sources.
        errors: messages naming a key and the fix; any one stops the run.
        warnings: notices of settings that are allowed but probably unintended.
    """

    def __init__(self, cfg: Config, derived: frozenset[str] = frozenset()):
        self.cfg = cfg
        self.derived = derived
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def check(self, key: str, ok: Callable[[Any], bool], message: str) -> None:
        """An error ``key=value message`` when the value of ``key`` fails ``ok``."""
        if key in self.derived:
            return  # the same check of its source names the key the user wrote
        value = _get(self.cfg, key)
        if not ok(value):  # comparisons with NaN are False, so NaN fails every range
            self.errors.append(f"{key}={value!r} {message}")

    def errors_name(self, *keys: str) -> bool:
        """Whether an error found so far is about one of ``keys`` (``key=value ...``)."""
        return any(e.startswith(f"{key}=") for e in self.errors for key in keys)

    def unused(self, key: str, why: str) -> None:
        """An error ``key=value changes nothing: why`` when ``key`` holds another value than
        its default while ``why`` (a sentence with the fix; ``{key}`` is filled in) makes it
        change nothing: a value the user gave that the run would silently ignore."""
        value = _get(self.cfg, key)
        if value != _get(_defaults(), key):
            self.errors.append(f"{key}={value!r} changes nothing: {why.format(key=key)}")

    def choice(
        self, key: str, value: Any, names: Sequence[str], what: str, hint: str = "", *,
        valid: str = "names",
    ) -> None:  # fmt: skip
        """An error with a did-you-mean when ``value`` is not one of ``names``."""
        if value in names:
            return
        self.errors.append(
            f"{key}={value!r} is not {what}{did_you_mean(value, names)}; valid {valid}: "
            f"{', '.join(names)}" + (f"; {hint}" if hint else "")
        )

    def name(self, key: str, value: str, registry: Any) -> None:
        """An error with a did-you-mean when ``value`` is not a name of ``registry``."""
        if value in registry:
            return
        names = registry.names(aliases=True)
        self.errors.append(
            f"{key}={value!r} is not a known {registry.family}{did_you_mean(value, names)}; "
            f"valid names: {', '.join(names)}"
        )


@functools.cache
def _defaults() -> Config:
    """The defaults of ``lmrl train``'s config (read only)."""
    return Config()


def estimator_needs(name: str) -> frozenset[str] | None:
    """The inputs an advantage estimator declares it needs (``values``, ``index``...).

    Read from the ``lmrl.algos.advantages`` registry, so the config never lists estimators by
    name. None when the name is unknown (reported by ``check_registries``).
    """
    registry = _registry("lmrl.algos.advantages", "advantage_estimators")
    if name not in registry:
        return None
    return registry.needs(name)


def check_registries(c: Config, f: Findings) -> None:
    """Every registry-valued key names an entry of its registry."""
    adv = _registry("lmrl.algos.advantages", "advantage_estimators")
    f.name("algorithm.adv_estimator", c.algorithm.adv_estimator, adv)
    losses = _registry("lmrl.algos.losses", "policy_losses")
    f.name("actor.policy_loss.loss_mode", c.actor.policy_loss["loss_mode"], losses)
    kl = _registry("lmrl.algos.kl", "kl_estimators")
    f.name("algorithm.kl_penalty", c.algorithm.kl_penalty, kl)
    f.name("actor.kl_loss_type", c.actor.kl_loss_type, kl)
    if (
        c.algorithm.use_kl_in_reward
        and c.algorithm.kl_penalty in kl
        and "logits" in kl.needs(c.algorithm.kl_penalty)
    ):
        f.errors.append(
            f"algorithm.kl_penalty={c.algorithm.kl_penalty}: the KL over the whole vocabulary "
            "needs the logits, so it is a loss term only (actor.use_kl_loss=true, "
            "actor.kl_loss_type=full); in the reward use kl, abs, mse or low_var_kl"
        )
    modes = _registry("lmrl.algos.agg", "LOSS_AGG_MODES")
    for key in ("actor.loss_agg_mode", "critic.loss_agg_mode"):
        if key not in f.derived:
            f.choice(key, _get(c, key), modes, "a loss aggregation mode", valid="modes")
    if c.algorithm.filter_groups["enable"] and not c.reward.custom_reward_function.path:
        f.choice(
            "algorithm.filter_groups.metric",
            c.algorithm.filter_groups["metric"],
            filter_metrics(c),
            "a per-sample value of the built-in scorers",
            "a custom reward function's own extras may be named once "
            "reward.custom_reward_function.path is set",
        )
    mt = c.rollout.multi_turn
    if mt.enable and not mt.tool_path:
        for tool in mt.tools:
            f.choice(
                "rollout.multi_turn.tools",
                tool,
                builtin.BUILTIN_TOOLS,
                "a built-in tool (define your own in a file given as rollout.multi_turn.tool_path)",
            )
    if not c.reward.custom_reward_function.path:
        for source in c.reward.scorer_options or {}:
            if source not in builtin.DATA_SOURCES:
                f.errors.append(
                    f"reward.scorer_options.{source}: no built-in scorer has that data_source"
                    f"{did_you_mean(source, builtin.DATA_SOURCES)}; valid names: "
                    f"{', '.join(builtin.DATA_SOURCES)}"
                )


def filter_metrics(c: Config) -> tuple[str, ...]:
    """The names ``algorithm.filter_groups.metric`` may take with the built-in scorers."""
    names = builtin.SEQUENCE_METRICS
    if c.reward_model.rule_reward or not c.reward_model.enable:
        names += builtin.SCORER_EXTRAS
    if c.reward_model.enable:
        names += builtin.REWARD_MODEL_EXTRAS
    if c.reward.overlong_buffer["enable"]:
        names += builtin.OVERLONG_EXTRAS
    return names


def check_ranges(c: Config, f: Findings) -> None:
    """Single-key ranges (a key resolving derived is checked through its source)."""
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
        "resources.nnodes",
        "reward.overlap.chunks",
    ]
    ge1_or_null = [
        "data.val_batch_size",
        "rollout.log_prob_micro_batch_size",
        "ref.log_prob_micro_batch_size",
        "actor.ppo_micro_batch_size",
        "critic.ppo_micro_batch_size",
        "resources.num_cpus",
    ]
    for key in ge1:
        f.check(key, lambda x: x >= 1, "must be >= 1")
    for key in ge1_or_null:
        f.check(key, lambda x: x is None or x >= 1, "must be >= 1 (or null)")
    for key in (
        "trainer.critic_warmup",
        "model.lora_rank",
        "reward.num_workers",
    ):
        f.check(key, lambda x: x >= 0, "must be >= 0")
    f.check(
        "resources.n_gpus_per_node",
        lambda x: x >= 1,
        "must be >= 1 (workers per node: GPUs, or CPU processes when trainer.device=cpu)",
    )
    f.check(
        "resources.critic_workers",
        lambda x: x >= 0,
        "must be >= 0 (0 = the critic shares the actor's workers, N = a pool of N)",
    )
    if c.model.lora_rank > 0:
        f.check("model.lora_alpha", lambda x: x > 0, "must be > 0 when LoRA is on")
    if c.reward.manager == "batch":  # its function would see whatever rows stopped together
        f.check("reward.overlap.rows", lambda x: not x, "needs reward.manager=naive or dapo")
    _scoring_chunks(c, f)

    f.check(
        "actor.clip_ratio_c",
        lambda x: x > 1.0,
        "must be > 1.0 (the dual clip bounds a negative-advantage token's loss at "
        "-A * clip_ratio_c); use e.g. 3.0",
    )
    f.check("actor.clip_ratio", lambda x: x > 0, "must be > 0 (e.g. 0.2)")
    for key in ("actor.clip_ratio_low", "actor.clip_ratio_high"):
        f.check(key, lambda x: x is None or x >= 0, "must be >= 0 (or null = clip_ratio)")
    f.check("critic.cliprange_value", lambda x: x > 0, "must be > 0 (e.g. 0.5)")
    for key in ("actor.policy_loss.tau_pos", "actor.policy_loss.tau_neg"):
        f.check(key, lambda x: x > 0, "must be > 0")
    for key in ("algorithm.gamma", "algorithm.lam"):
        f.check(key, lambda x: 0.0 <= x <= 1.0, "must be in [0, 1]")
    for key in ("actor.kl_loss_coef", "algorithm.kl_ctrl.kl_coef"):
        f.check(key, lambda x: x >= 0, "must be >= 0")
    for section in ("actor", "critic"):
        f.check(f"{section}.grad_clip", lambda x: x > 0, "must be > 0 (e.g. 1.0)")
        f.check(f"{section}.optim.lr", lambda x: x >= 0, "must be >= 0")
        f.check(f"{section}.optim.weight_decay", lambda x: x >= 0, "must be >= 0")
        for key in ("lr_warmup_steps_ratio", "min_lr_ratio"):
            f.check(f"{section}.optim.{key}", lambda x: 0 <= x <= 1, "must be in [0, 1]")
        f.check(
            f"{section}.optim.betas",
            lambda x: len(x) == 2 and all(0 <= b < 1 for b in x),
            "must be two numbers in [0, 1), e.g. [0.9, 0.999]",
        )

    for prefix in ("rollout", "rollout.val_kwargs"):
        f.check(f"{prefix}.top_p", lambda x: 0 < x <= 1, "must be in (0, 1]; 1.0 = off")
        f.check(f"{prefix}.top_k", lambda x: x >= -1, "must be >= -1 (-1 or 0 = off)")
        f.check(f"{prefix}.temperature", lambda x: x >= 0, "must be >= 0")
        sampling = _get(c, f"{prefix}.do_sample")
        if sampling and not _get(c, f"{prefix}.temperature") > 0:
            f.errors.append(
                f"{prefix}.temperature={_get(c, f'{prefix}.temperature')} with "
                f"{prefix}.do_sample=true: sampling needs a temperature > 0; raise it "
                f"(e.g. 1.0) or set {prefix}.do_sample=false for greedy decoding"
            )
    f.check("rollout.stop", lambda x: all(s for s in x), "must not contain empty strings")
    f.check("reward.timeout_s", lambda x: x > 0, "must be > 0 (seconds)")
    f.check("trainer.max_rollbacks", lambda x: x >= 0, "must be >= 0 (0 = no rollback)")
    f.check("trainer.rollback_lr_factor", lambda x: 0 < x < 1, "must be in (0, 1), e.g. 0.1")
    if c.trainer.max_rollbacks == 0 and not f.errors_name(*ROLLBACK_KEYS):
        for key in ROLLBACK_KEYS:
            f.unused(key, "trainer.max_rollbacks=0 turns the rollback off; set "
                     "trainer.max_rollbacks > 0 (e.g. 2) or leave {key} out")  # fmt: skip
    f.check(
        "trainer.parity_threshold",
        lambda x: x is None or x >= 0,
        "must be a number >= 0, in nats (0 or null = off)",
    )
    if c.trainer.max_rollbacks > 0 and (not c.data.val_files or c.trainer.test_freq <= 0):
        f.errors.append(f"trainer.max_rollbacks={c.trainer.max_rollbacks} (the rollback) needs "
                        "validation to find the best checkpoint: set data.val_files and "
                        "trainer.test_freq > 0")  # fmt: skip
    for key, ok, message in RUN_CHECKS:
        f.check(key, ok, message)
    f.check("algorithm.filter_groups.metric", lambda x: x != "", "must name a per-sample metric")


#: the keys of the run doctor's rollback besides its switch, ``trainer.max_rollbacks``
ROLLBACK_KEYS = ("trainer.rollback_lr_factor",)


def _scoring_chunks(c: Config, f: Findings) -> None:
    """``reward.overlap.chunks`` against the prompts a step generates in one round
    (``data.gen_batch_size`` under dynamic sampling, else ``data.train_batch_size``): more
    calls than prompts would be cut to one call per prompt; calls of unequal sizes are
    allowed (a notice)."""
    chunks = c.reward.overlap["chunks"]
    dynamic = c.algorithm.filter_groups["enable"] and "data.gen_batch_size" not in f.derived
    key = "data.gen_batch_size" if dynamic else "data.train_batch_size"
    prompts = _get(c, key)
    if chunks < 1 or prompts < 1:
        return  # reported by the range checks
    if chunks > prompts:
        f.errors.append(
            f"reward.overlap.chunks={chunks} is more calls than the {prompts} prompts a step "
            f"generates ({key}={prompts}), and a call holds whole groups; set "
            f"reward.overlap.chunks <= {prompts}, a divisor of it for calls of one size"
        )
    elif prompts % chunks:
        f.warnings.append(
            f"reward.overlap.chunks={chunks} does not divide the {prompts} prompts a step "
            f"generates ({key}={prompts}): its calls differ in size (the samples are the "
            f"same); a divisor such as {_divisor_at_most(prompts, chunks)} gives equal calls"
        )


def check_mixture(c: Config, f: Findings) -> None:
    """``data.mixture``'s rules (`lmrl.config.mixture.parse_mixture`), quotas against the
    prompts a step draws; its sources are matched to the data when the data is read."""
    dynamic = c.algorithm.filter_groups["enable"]
    batch = (c.data.gen_batch_size if dynamic else None) or c.data.train_batch_size
    try:
        parse_mixture(c.data.mixture, batch)
    except ConfigError as err:
        f.errors.append(str(err))


def check_batch_sizes(c: Config, f: Findings) -> None:
    """Batch sizes that must divide each other and the workers."""
    b, n = c.data.train_batch_size, c.rollout.n
    if b < 1 or n < 1:
        return  # already reported by ranges()
    workers = c.resources.nnodes * c.resources.n_gpus_per_node
    workers = workers if c.trainer.backend == "ray" else 1
    if workers < 1 or c.resources.critic_workers < 0:
        return  # already reported by ranges()
    _batches(c, f, "actor", b, n, workers)
    critic_sizes = (c.critic.ppo_mini_batch_size, c.critic.ppo_micro_batch_size)
    if c.critic.enable and critic_sizes != (
        c.actor.ppo_mini_batch_size,
        c.actor.ppo_micro_batch_size,
    ):
        _batches(c, f, "critic", b, n, c.resources.critic_workers or workers)
    elif c.critic.enable and c.trainer.backend == "ray" and c.resources.critic_workers:
        _batches(c, f, "critic", b, n, c.resources.critic_workers)


def _batches(c: Config, f: Findings, section: str, b: int, n: int, workers: int) -> None:
    m = _get(c, f"{section}.ppo_mini_batch_size")
    micro = _get(c, f"{section}.ppo_micro_batch_size")
    if m < 1 or (micro is not None and micro < 1):
        return  # already reported by ranges()
    key = f"{section}.ppo_mini_batch_size"
    if m > b:
        f.errors.append(
            f"{key}={m} is larger than data.train_batch_size={b}: a mini-batch is a slice "
            f"of the step's prompts; lower {key} (e.g. {_divisor_at_most(b, b)}) or raise "
            "data.train_batch_size"
        )
        return
    if b % m:
        f.errors.append(
            f"data.train_batch_size * rollout.n = {b}*{n} = {b * n} sequences do not split "
            f"into mini-batches of {key} * rollout.n = {m}*{n} = {m * n}; set {key} to a "
            f"divisor of {b} (e.g. {_divisor_at_most(b, m)})"
        )
        return
    sequences = m * n
    if sequences % workers:
        f.errors.append(
            f"{key} * rollout.n = {sequences} sequences cannot be shared evenly by "
            f"{workers} workers (resources.nnodes * resources.n_gpus_per_node); make it a "
            f"multiple of {workers}"
        )
        return
    per_worker = sequences // workers
    if micro is not None and per_worker % micro:
        share = f" / {workers} workers" if workers > 1 else ""
        f.errors.append(
            f"{section}.ppo_micro_batch_size={micro} does not divide the mini-batch of "
            f"{per_worker} sequences ({key} * rollout.n{share} = {m}*{n}{share}); set it to "
            f"a divisor of {per_worker} (e.g. {_divisor_at_most(per_worker, micro)})"
        )


def check_reward(c: Config, f: Findings) -> None:
    """The reward model, DAPO's overlong buffer, the built-in scorers' options."""
    if c.reward_model.enable and not c.reward_model.model.path:
        f.errors.append(
            "reward_model.enable=true needs reward_model.model.path=<a sequence-"
            "classification model with num_labels=1>"
        )
    ob = c.reward.overlong_buffer
    if ob["enable"]:
        if c.reward.manager != "dapo":
            f.errors.append(
                f"reward.overlong_buffer.enable=true needs reward.manager=dapo (got "
                f"{c.reward.manager!r}); set reward.manager=dapo"
            )
        if not 0 < ob["len"] <= c.data.max_response_length:
            f.errors.append(
                f"reward.overlong_buffer.len={ob['len']} must be in [1, "
                f"data.max_response_length={c.data.max_response_length}] when the overlong "
                "penalty is on"
            )
        if ob["penalty_factor"] < 0:
            f.errors.append(
                f"reward.overlong_buffer.penalty_factor={ob['penalty_factor']} must be >= 0"
            )
    _scorer_options(c, f)


def _scorer_options(c: Config, f: Findings) -> None:
    """``reward.scorer_options``: mappings, and only beside the built-in scorers (their
    names and options are checked where the scorers live, when the reward is built)."""
    options = c.reward.scorer_options or {}
    if options and c.reward.custom_reward_function.path:
        f.errors.append(
            "reward.scorer_options set the built-in scorers' options, but "
            "reward.custom_reward_function.path replaces them; pass options to your "
            "function with reward.custom_reward_function.reward_kwargs"
        )
        return
    for source, kwargs in options.items():
        if not isinstance(kwargs, dict):
            f.errors.append(
                f"reward.scorer_options.{source} must be a mapping of options, e.g. "
                f"{{binary: true}}, got {kwargs!r}"
            )


def check_algorithm(c: Config, f: Findings) -> None:
    """The estimator against the critic and the group size; dynamic sampling; the KL terms."""
    needs = estimator_needs(c.algorithm.adv_estimator) or frozenset()
    if "values" in needs and not c.critic.enable:
        f.errors.append(
            f"algorithm.adv_estimator={c.algorithm.adv_estimator} needs a critic (values), "
            "but critic.enable=false; set critic.enable=true (or null), or pick a "
            "critic-free estimator such as grpo"
        )
    if c.critic.enable and "values" not in needs:
        f.warnings.append(
            f"critic.enable=true with algorithm.adv_estimator={c.algorithm.adv_estimator}: "
            "the critic is trained but its values are not used by the advantages"
        )
    if "index" in needs and c.rollout.n == 1:
        f.errors.append(
            f"algorithm.adv_estimator={c.algorithm.adv_estimator} compares the responses "
            "to the same prompt, but rollout.n=1 gives groups of one (no baseline: the raw "
            "score becomes the advantage); set rollout.n >= 2 (e.g. rollout.n=8), or use "
            "reinforce_plus_plus / remax / gae for one response per prompt"
        )
    if c.algorithm.filter_groups["enable"] and c.rollout.n == 1:
        f.errors.append(
            "algorithm.filter_groups.enable=true with rollout.n=1: every group has one "
            "response and zero spread, so every group would be dropped; set rollout.n >= 2"
        )
    kl_ctrl = c.algorithm.kl_ctrl
    if kl_ctrl["type"] == "adaptive":
        for name in ("target_kl", "horizon"):
            value = kl_ctrl[name]
            if value is None or value <= 0:
                f.errors.append(
                    f"algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.{name} > 0, "
                    f"got {value!r}; set it (e.g. target_kl=0.1, horizon=10000) or use "
                    "algorithm.kl_ctrl.type=fixed"
                )
    if c.algorithm.use_kl_in_reward and c.actor.use_kl_loss:
        f.warnings.append(
            "algorithm.use_kl_in_reward=true and actor.use_kl_loss=true: the KL to the "
            "reference is penalized twice (in the reward and in the loss)"
        )


def check_placement(c: Config, f: Findings) -> None:
    """The backend and the resources it places workers on."""
    if c.trainer.backend == "ray" and importlib.util.find_spec("ray") is None:
        f.errors.append(
            "trainer.backend=ray needs Ray, which is not installed here: "
            "pip install 'lmrl[ray]' (or use trainer.backend=local)"
        )
    address = c.resources.ray_address
    problem = ray_address_problem(address) if address is not None else None
    if problem:
        f.errors.append(f"resources.ray_address={address!r} {problem}")
    placed = c.resources.nnodes * c.resources.n_gpus_per_node
    if c.trainer.backend == "local" and placed > 1:
        f.warnings.append(
            f"resources (nnodes * n_gpus_per_node = {placed}) place Ray workers only; "
            "trainer.backend=local runs in one process on one device"
        )


def check_precision(c: Config, f: Findings) -> None:
    """fp16 on a CPU (no fp16 kernels there), for the trained models' compute dtype and the
    rollout's own dtype alike; the rest needs the device and is checked when the models load
    (``lmrl.workers.precision.Precision.from_config``)."""
    auto = c.model.mixed_precision.param_dtype == "auto"
    trained = "model.dtype" if auto else "model.mixed_precision.param_dtype"
    for key in (trained, "rollout.dtype"):
        compute = _get(c, key)
        if c.trainer.device == "cpu" and compute in ("float16", "fp16"):
            f.errors.append(
                f"{key}={compute}: float16 compute on a CPU is not supported; use bfloat16 or "
                "float32 (trainer.device=cpu)"
            )


def ray_address_problem(address: str) -> str | None:
    """Why ``address`` cannot be what ``ray.init(address=...)`` joins, or None.

    Ray takes ``auto``, the head's GCS address ``host:port`` (``ray start --head`` prints
    ``host:6379``) or a Ray Client address ``ray://host:10001``; a dashboard or job-server
    URL (``http://host:8265``) is the usual slip, and is named as such.
    """
    wants = "Ray joins a cluster at its head's host:6379, ray://host:10001 (Ray Client) or auto"
    scheme, sep, rest = address.partition("://")
    if sep and scheme.lower() in ("http", "https"):
        return f"is the URL of Ray's dashboard or job server, not of the cluster; {wants}"
    if sep and scheme != "ray":
        return f"has the scheme {scheme}://, which Ray does not know; {wants}"
    if address == "auto":
        return None
    host, _, port = (rest if sep else address).rpartition(":")
    if not host or not port.isdigit():
        return f"is not host:port; {wants}"
    return None


def _registry(module: str, name: str) -> Any:
    """``module.name``, imported when first needed (``import lmrl.config`` imports no torch)."""
    return getattr(importlib.import_module(module), name)


def did_you_mean(value: str, names: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean 'x'?)`` for the name of ``names`` closest to ``value``, or ``""``."""
    close = difflib.get_close_matches(str(value), list(names), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _divisor_at_most(total: int, limit: int) -> int:
    """The largest divisor of ``total`` that is <= ``limit`` (at least 1)."""
    return max((d for d in range(1, max(1, min(total, limit)) + 1) if total % d == 0), default=1)


#: the checks ``validate_config`` runs, in order
CHECKS: tuple[Callable[[Config, Findings], None], ...] = (
    check_registries,
    check_ranges,
    check_mixture,
    check_curriculum,
    check_batch_sizes,
    check_rollout,
    check_reward,
    check_algorithm,
    check_placement,
    check_precision,
    check_async,
)
