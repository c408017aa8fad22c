"""Reward functions: the built-in scorers or the user's, wrapped with a name and a weight.

Three calling conventions are accepted, told apart by one documented rule:

- **per sample** (verl's ``compute_score``): ``fn(data_source, solution_str, ground_truth,
  extra_info, **kwargs) -> float | dict``, a dict holding ``"score"`` plus extra values;
- **batched** (TRL's reward functions): ``fn(prompts, completions, **columns) -> list[float |
  None]`` with one entry per completion; ``None`` means "this function does not score this
  sample" (TRL's convention: the sample's reward is the sum of the functions that do, and a
  sample no function scores is left out of training and counted, see
  ``lmrl.rewards.managers``). The columns passed are ``data_source``, ``ground_truth``,
  ``extra_info``, ``completion_ids`` and ``uid`` when the batch has it;
- **verl's batch** (the scorer of verl's ``BatchRewardManager``): ``fn(data_sources,
  solution_strs, ground_truths, extra_infos, **kwargs) -> list[float | dict]``, called with
  exactly these four keywords (plus the ``kwargs`` of `RewardFunction`) as verl calls it:
  ``data_sources`` and ``extra_infos`` numpy object arrays, ``solution_strs`` and
  ``ground_truths`` lists. It is a batched function (the whole batch under
  ``reward.manager=batch``, one-sample lists under ``naive``).

The rule: a function with a parameter named ``solution_strs`` takes verl's batch convention;
otherwise ``batched=True``/``False`` given explicitly wins, a function with a parameter named
``completions`` is batched, one with ``solution_str`` is per sample, and any other signature
is an error asking for ``batched=``. Arguments a function does not declare (and cannot take
through ``**kwargs``) are not passed, so ``fn(solution_str, ground_truth)`` works.

Everything that comes back is checked here (`normalize_value`): a number or 0-d array, or a
dict with a finite ``"score"`` (``{"score": None}``: the function does not score the sample,
as a batched function's ``None``); anything else (NaN, inf, a string, a bare ``None`` from a
per-sample function, a list of the wrong length) is an error for that sample, with a message that says
what came back (``returned None``, ``a dict without 'score'``, ``returned 3 scores for 8
samples``). These helpers never raise: they return an `Outcome` per sample, so the worker
processes and the in-process path share them. Loading a function (a missing file, an import
error, a missing name, an undetectable convention) raises `lmrl.errors.RewardError`, naming
the file and the function.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from lmrl._userfile import UserFileError, import_user_file
from lmrl.errors import RewardError

PER_SAMPLE_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
VERL_BATCH_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


class Outcome(NamedTuple):
    """What one reward function gave one sample.

    ``status`` is ``"ok"`` (``score`` and ``extras`` valid), ``"none"`` (the function does not
    score the sample: a batched function's None, or ``{"score": None}``; its extras kept),
    ``"error"`` or ``"timeout"`` (``message`` says why); the score is 0.0 unless ``"ok"``.
    """

    status: str
    score: float = 0.0
    extras: dict[str, Any] = {}  # noqa: RUF012 (shared default, read-only: readers copy it)
    message: str = ""


def failed(status: str, message: str) -> Outcome:
    """A zero-score outcome of ``status`` ``"error"`` or ``"timeout"``."""
    return Outcome(status, 0.0, {}, message)


class FileFunction:
    """A function loaded from a Python file, picklable by (path, name).

    Worker processes receive the path and the name and import the file again, so a reward
    function defined in a user's script reaches them without being importable as a module.

    Raises:
        RewardError: the file does not exist, cannot be imported, or lacks ``name``, or
            ``name`` is not callable (the message names the file and the function).
    """

    def __init__(self, path: str | Path, name: str):
        self.path = str(Path(path).expanduser().resolve())
        self.name = name
        self.fn = self._load()

    def _load(self) -> Callable:
        try:
            module = import_user_file(self.path, "lmrl_user_reward")
        except UserFileError as err:
            failed = str(err).startswith("failed")
            what = f"{'importing ' if failed else ''}custom reward function file"
            raise RewardError(
                f"{what} {self.path} {err} (looking for function {self.name!r})"
            ) from err.__cause__
        fn = getattr(module, self.name, None)
        if fn is None:
            found = sorted(k for k, v in vars(module).items() if callable(v) and k[0] != "_")
            raise RewardError(
                f"custom reward function {self.name!r} not found in {self.path}; "
                f"callables there: {found}"
            )
        if not callable(fn):
            raise RewardError(
                f"custom reward function {self.name!r} in {self.path} is not callable "
                f"(it is a {type(fn).__name__})"
            )
        return fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __getstate__(self) -> dict:
        return {"path": self.path, "name": self.name}

    def __setstate__(self, state: dict) -> None:
        self.path, self.name = state["path"], state["name"]
        self.fn = self._load()

    def __repr__(self) -> str:
        return f"FileFunction({self.path!r}, {self.name!r})"


def _target(fn: Callable) -> Callable:
    return fn.fn if isinstance(fn, FileFunction) else fn


def describe(fn: Callable, name: str) -> str:
    """``'name'``, plus ``in <file>`` for a function loaded from a file (for messages)."""
    return f"{name!r} in {fn.path}" if isinstance(fn, FileFunction) else repr(name)


@dataclass
class RewardFunction:
    """One reward function with its name, weight and calling convention.

    Args:
        fn: the callable (a `FileFunction` for one loaded from a file).
        name: used in metrics and in extras keys when several functions are combined.
        weight: the sample's score is ``sum(weight * score)`` over the functions.
        batched: the calling convention; None = detect (see the module docstring).
        kwargs: extra keyword arguments passed on every call (verl's ``reward_kwargs``).

    Attributes:
        plural: the function takes verl's batch convention (a ``solution_strs`` parameter).

    Raises:
        RewardError: the convention cannot be detected, ``batched=False`` for a function of
            verl's batch convention, or the weight is not finite.
    """

    fn: Callable
    name: str = ""
    weight: float = 1.0
    batched: bool | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    accepts: frozenset[str] | None = field(init=False, default=None)
    plural: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        target = _target(self.fn)
        if not self.name:
            self.name = getattr(target, "__name__", type(target).__name__)
        if not isinstance(self.weight, numbers.Real) or not math.isfinite(self.weight):
            raise RewardError(
                f"reward function {describe(self.fn, self.name)}: weight must be finite, "
                f"got {self.weight!r}"
            )
        self.weight = float(self.weight)
        try:
            params = inspect.signature(target).parameters
        except (TypeError, ValueError):  # builtins without a signature: pass everything
            params = {}
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        self.accepts = None if var_kw or not params else frozenset(params)
        self.plural = "solution_strs" in params
        if self.plural:
            if self.batched is False:
                raise RewardError(
                    f"reward function {describe(self.fn, self.name)} takes verl's batch "
                    f"arguments {list(VERL_BATCH_ARGS)}: it scores lists of samples, so "
                    "batched=False cannot call it; leave batched unset"
                )
            self.batched = True
        elif self.batched is None:
            if "completions" in params:
                self.batched = True
            elif "solution_str" in params:
                self.batched = False
            else:
                raise RewardError(
                    f"cannot tell how to call reward function {describe(self.fn, self.name)} "
                    f"(parameters {list(params)}): a parameter 'completions' means batched "
                    "(prompts, completions, **columns), 'solution_str' means per sample "
                    "(data_source, solution_str, ground_truth, extra_info), 'solution_strs' "
                    "means verl's batch (data_sources, solution_strs, ground_truths, "
                    "extra_infos); or pass batched=True/False"
                )

    def _filter(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        merged = {**kwargs, **self.kwargs}
        if self.accepts is None:
            return merged
        return {k: v for k, v in merged.items() if k in self.accepts}

    def call_per_sample(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any
    ) -> Outcome:
        """Call a per-sample function on one sample; never raises."""
        args = dict(
            data_source=data_source,
            solution_str=solution_str,
            ground_truth=ground_truth,
            extra_info=extra_info,
        )
        try:
            value = self.fn(**self._filter(args))
        except Exception as err:
            return failed("error", f"{self.name} raised {type(err).__name__}: {err}")
        return normalize_value(value, self.name)

    def call_batched(
        self, prompts: Sequence[Any], completions: Sequence[str], columns: Mapping[str, Sequence]
    ) -> list[Outcome]:
        """Call a batched function on ``len(completions)`` samples; never raises."""
        n = len(completions)
        if self.plural:  # verl's BatchRewardManager's call, keyword for keyword
            args = {
                "data_sources": _objects(columns["data_source"]),
                "solution_strs": list(completions),
                "ground_truths": list(columns["ground_truth"]),
                "extra_infos": _objects(columns["extra_info"]),
            }
        else:
            args = {"prompts": prompts, "completions": completions, **columns}
        try:
            values = self.fn(**self._filter(args))
        except Exception as err:
            return [failed("error", f"{self.name} raised {type(err).__name__}: {err}")] * n
        if isinstance(values, str | bytes | dict) or not hasattr(values, "__len__"):
            what = "None" if values is None else type(values).__name__
            msg = f"{self.name} returned {what}, expected a list of {n} scores"
            return [failed("error", msg)] * n
        if len(values) != n:
            msg = f"{self.name} returned {len(values)} scores for {n} samples"
            return [failed("error", msg)] * n
        return [Outcome("none") if v is None else normalize_value(v, self.name) for v in values]

    def call(self, task: tuple) -> Outcome | list[Outcome]:
        """Run one task: ``("sample", (data_source, solution_str, ground_truth, extra_info))``
        or ``("batch", (prompts, completions, columns))``."""
        kind, args = task
        return self.call_batched(*args) if kind == "batch" else self.call_per_sample(*args)


def _objects(values: Sequence[Any]) -> np.ndarray:
    """``values`` as a 1-D numpy object array (a verl batch's non-tensor column), each item
    kept as it is (a list or a dict is one item)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def _as_float(value: Any) -> float | None:
    """``value`` as a float if it is a real number or a 0-d array, else None."""
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "ndim", None) == 0 and getattr(value, "shape", None) == ():
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    return None


def normalize_value(value: Any, who: str) -> Outcome:
    """Check what a reward function returned and turn it into an `Outcome`.

    A number (or 0-d array) is the score; a dict needs a ``"score"``, and its other entries
    become extras (numbers as floats, None kept, anything else as its ``str``); a dict whose
    ``"score"`` is None is a ``"none"`` outcome (the function does not score the sample). A
    score that is not finite, a missing ``"score"`` or another type is an ``"error"`` outcome.
    """
    extras: dict[str, Any] = {}
    if isinstance(value, dict):
        if "score" not in value:
            return failed("error", f"{who} returned a dict without 'score': keys {sorted(value)}")
        for key, item in value.items():
            if key == "score":
                continue
            as_float = _as_float(item)
            extras[str(key)] = (
                as_float if as_float is not None else (None if item is None else str(item))
            )
        value = value["score"]
        if value is None:
            return Outcome("none", 0.0, extras)
    score = _as_float(value)
    if value is None:
        return failed("error", f"{who} returned None, expected a number or a dict with 'score'")
    if score is None:
        return failed(
            "error", f"{who} returned {type(value).__name__} {value!r:.80}, expected a number"
        )
    if not math.isfinite(score):
        return failed("error", f"{who} returned a non-finite score {score}")
    return Outcome("ok", score, extras)


def load_reward_fn(
    path: str | Path,
    name: str = "compute_score",
    *,
    weight: float = 1.0,
    batched: bool | None = None,
    kwargs: dict[str, Any] | None = None,
) -> RewardFunction:
    """Load a reward function from a Python file (verl's ``custom_reward_function.path/.name``).

    Args:
        path: the ``.py`` file.
        name: the function's name in it (verl's default ``compute_score``).
        weight: its weight when several functions are combined.
        batched: the calling convention; None = detect from the parameter names.
        kwargs: keyword arguments passed on every call (verl's ``reward_kwargs``).

    Returns:
        A `RewardFunction` named ``name``, picklable (workers re-import the file).

    Raises:
        RewardError: a missing file, an import error, a missing name, or an undetectable
            convention; the message names the file and the function.
    """
    return RewardFunction(
        FileFunction(path, name),
        name=name,
        weight=weight,
        batched=batched,
        kwargs=dict(kwargs or {}),
    )
