"""The verl translation table: the one place that knows verl's key paths.

A verl user's command line or YAML carries over: every key goes through ``translate``, which
rewrites verl's paths onto ours (``actor_rollout_ref.actor.clip_ratio -> actor.clip_ratio``),
renames the few keys whose names differ (``*_per_gpu`` micro-batch sizes, ``warmup_style``),
and accepts keys that only make sense on verl's GPU stack (FSDP, vLLM, dynamic batching...)
with a one-line notice instead of dropping them silently.

The table serves lmrl's config schemas: each rule names the targets it applies to,
``TRAIN`` (``lmrl train``'s ``Config``, verl's ``ppo_trainer.yaml``), ``SFT`` (``lmrl sft``'s
``SFTConfig``, verl's ``sft_trainer.yaml``: ``model.partial_pretrain -> model.path``,
``optim.clip_grad -> optim.grad_clip``...) or ``FLOW`` (``lmrl train-flow``'s ``FlowConfig``,
Flow-GRPO's ``config/base.py`` names: ``sample.noise_level``, ``train.clip_range``...);
``translate(key, value, target)`` matches a key against that target's rules only.

The choice this module makes: rules are applied repeatedly until none matches, so a verl
section prefix and one of our renames compose (``actor_rollout_ref.actor.X_per_gpu`` ->
``actor.X_per_gpu`` -> ``actor.X``), and the renames also accept the verl spelling written in
our layout. A verl switch that would change something lmrl cannot do (``reward_model.enable``
true, ``multi_turn.enable`` true) is an error rather than a notice. Where lmrl folds several
verl keys into one, each still maps onto it: the vLLM engine keys onto options of
``rollout.vllm``, the two FSDP offload flags onto ``actor.offload`` / ``critic.offload`` (each
switching its own part, ``Rule.flag``), Search-R1's ``retriever.url`` onto ``retriever.source``
(only a URL: ``Rule.accepts``), verl's ``launch_reward_fn_async`` onto an option of
``reward.overlap``. lmrl's own keys folded since keep translating the same way
(``reward.in_flight_chunks`` -> ``reward.overlap.chunks``, the ``trainer.rollback`` switch onto
``trainer.max_rollbacks``: ``Rule.count``). Two keys that land on one key of ours with
different values (the actor's and the critic's ``param_dtype``) are refused by the loader,
naming both (``lmrl.config.setters``): lmrl has one value where verl has one per role.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmrl.config.verl_table import (  # noqa: F401  (the table's names, re-exported)
    FLOW,
    OFFLOAD_FLAGS,
    SFT,
    TARGETS,
    TRAIN,
    VERL_RULES,
    Rule,
    _count_switch,
    _switch,
)


@dataclass(frozen=True)
class Translation:
    """What one incoming ``key=value`` becomes.

    Attributes:
        key: the key as given.
        path: our dotted path to set, or None when nothing is set.
        value: the value to set there.
        notice: a one-line notice (the key was accepted but changes nothing here).
        error: a message when the key's value asks for something lmrl cannot do.
        update: when set, the value to set is ``update(the path's current value)`` (one of
            several verl switches folded into one key); ``value`` is the switch as given.
        also: more of our paths that take ``value`` unless a key of the config sets them
            (Flow-GRPO's ``dataset`` is both the training and the validation prompts).
    """

    key: str
    path: str | None
    value: Any = None
    notice: str | None = None
    error: str | None = None
    update: Callable[[Any], Any] | None = None
    also: tuple[str, ...] = ()


def rules_for(target: str) -> tuple[Rule, ...]:
    """The rules of the table that apply to ``target`` (``TRAIN`` or ``SFT``), in order."""
    if target not in TARGETS:
        raise ValueError(f"unknown translation target {target!r}; valid: {', '.join(TARGETS)}")
    return tuple(r for r in VERL_RULES if target in r.targets)


@dataclass(frozen=True)
class _Index:
    """One target's rules, by kind of pattern."""

    exact: dict[str, Rule]
    prefix: list[Rule]  # ``X.*``, longest first
    suffix: list[Rule]  # ``*.name``


@functools.cache
def _index(target: str) -> _Index:
    rules = rules_for(target)
    seen = {r.verl for r in rules}
    if len(seen) < len(rules):  # one rule per key and target: the order never decides
        twice = sorted(v for v in seen if sum(r.verl == v for r in rules) > 1)
        raise ValueError(f"the verl table has several {target} rules for {twice}")
    exact = {r.verl: r for r in rules if not r.verl.endswith(".*") and not r.verl.startswith("*.")}
    prefix = sorted((r for r in rules if r.verl.endswith(".*")), key=lambda r: -len(r.verl))
    return _Index(exact, prefix, [r for r in rules if r.verl.startswith("*.")])


def _match(path: str, target: str) -> Rule | None:
    index = _index(target)
    if path in index.exact:
        return index.exact[path]
    for rule in index.prefix:
        if path.startswith(rule.verl[:-1]):
            return rule
    for rule in index.suffix:
        if path.endswith(rule.verl[1:]):
            return rule
    return None


def _rewrite(rule: Rule, path: str) -> str:
    if rule.verl.endswith(".*"):
        return rule.ours[:-1] + path[len(rule.verl) - 1 :]
    return rule.ours


def _same(a: Any, b: Any) -> bool:
    """Equal values, where a bool only equals the same bool (``0 == False`` is not a match) and
    a number written as YAML reads it, a string (``1e-8``: YAML 1.1 floats need a dot), equals
    that number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, str) and isinstance(b, int | float):
        try:
            return float(a) == b
        except ValueError:
            return False
    return a == b


def translate(key: str, value: Any, target: str = TRAIN) -> Translation:
    """Map one incoming key (verl's layout or ours) and its value onto a schema of ours.

    Args:
        key: dotted key as given (``actor_rollout_ref.actor.clip_ratio``).
        value: its parsed value.
        target: the schema: ``TRAIN`` (``Config``, default) or ``SFT`` (``SFTConfig``).
    Returns:
        A ``Translation``; a key no rule knows is returned unchanged (the caller checks it
        against the schema).
    """
    path, also = key, ()
    for _ in range(8):  # rules compose a few times at most; the bound guards against cycles
        rule = _match(path, target)
        if rule is None:
            break
        if any(_same(value, s) for s in rule.skip):
            return Translation(key, None, notice=f"{key}={value!r} changes nothing: {rule.note}")
        if rule.ours is None:
            return _accept(key, value, rule)
        if rule.accepts is not None and (problem := rule.accepts(value)) is not None:
            return Translation(key, None, error=f"{key}={value!r}: {problem}")
        if rule.values:
            mapped = [ours for theirs, ours in rule.values if _same(value, theirs)]
            if not mapped:
                valid = ", ".join(str(theirs) for theirs, _ in rule.values)
                return Translation(key, None, error=f"{key}={value!r}: expected one of {valid}")
            return Translation(key, rule.ours, mapped[0])
        if rule.index is not None:
            return Translation(
                key, rule.ours, value, update=functools.partial(_set_item, rule.index, value)
            )
        if rule.flag is not None or rule.count is not None:
            if not isinstance(value, bool):
                return Translation(key, None, error=f"{key}: expected true or false, got {value!r}")
            update = (
                functools.partial(_switch, rule.flag, value)
                if rule.flag is not None
                else functools.partial(_count_switch, rule.count, value)
            )
            return Translation(key, rule.ours, value, update=update)
        also = also or rule.also
        new = _rewrite(rule, path)
        if new == path:
            break
        path = new
    return Translation(key, path, value, also=also)


def _set_item(index: int, value: Any, current: list) -> list:
    """``current`` (a list key of ours) with item ``index`` set to ``value``."""
    return [value if i == index else v for i, v in enumerate(current)]


def _accept(key: str, value: Any, rule: Rule) -> Translation:
    if rule.when_true is not None:
        if value is True:
            return Translation(key, rule.when_true[0], rule.when_true[1])
        if value is False or value is None:
            return Translation(key, None, notice=f"{key}={value!r} changes nothing: {rule.note}")
        return Translation(key, None, error=f"{key}: expected true or false, got {value!r}")
    if rule.only and not any(_same(value, v) for v in rule.only):
        allowed = " or ".join(repr(v) for v in rule.only)
        return Translation(
            key,
            None,
            error=f"{key}={value!r}: {rule.note}; remove it or set it to {allowed}",
        )
    return Translation(key, None, notice=f"{key}={value!r} changes nothing in lmrl: {rule.note}")


def verl_spellings(path: str, target: str = TRAIN) -> list[str]:
    """The verl spellings of one of our paths of ``target`` (for did-you-mean suggestions)."""
    index = _index(target)
    out = []
    for rule in index.prefix:
        if rule.ours is not None and path.startswith(rule.ours[:-1]):
            out.append(rule.verl[:-1] + path[len(rule.ours) - 1 :])
    for rule in index.exact.values():
        if rule.ours == path and rule.verl != path:
            out.append(rule.verl)
    return out


def section_prefixes(target: str = TRAIN) -> list[tuple[str, str]]:
    """The ``(verl prefix, our prefix)`` pairs of ``target``'s rules, for the help text."""
    return [
        (r.verl, r.ours) for r in rules_for(target) if r.verl.endswith(".*") and r.ours is not None
    ]


def renames(target: str = TRAIN) -> list[tuple[str, str]]:
    """The ``(verl key, our key)`` pairs of ``target``'s rules that set a key, for help texts
    (a switch shows what it sets, a list item its index, a value map its values)."""
    out = []
    for r in rules_for(target):
        if r.ours is not None:
            ours = r.ours if r.index is None else f"{r.ours}[{r.index}]"
            if r.values:
                ours += " (" + ", ".join(f"{a} = {b}" for a, b in r.values) + ")"
            out.append((r.verl, ours))
        elif r.when_true is not None:
            out.append((f"{r.verl}=true", f"{r.when_true[0]}={r.when_true[1]}"))
    return out
