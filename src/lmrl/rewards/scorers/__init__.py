"""Built-in scorers, chosen by a sample's ``data_source``.

Every scorer has the signature ``fn(solution_str, ground_truth, extra_info=None, **options) ->
float | dict`` (a dict holds ``"score"`` plus extra per-sample values such as ``acc``).
``SCORERS`` is the table from ``data_source`` to scorer; a dataset's own names (verl's
``openai/gsm8k``, ``lighteval/MATH``, Logic-RL's ``kk_logic``...) are listed next to ours,
so verl's preprocessed parquet files score without a custom function; `get_scorer` looks a
name up and raises a ``ValueError`` listing the valid ones. Every built-in scorer needs a
ground truth: ``None`` (a row without ``reward_model.ground_truth``) is an error, not a 0.

Choice: a plain read-only mapping rather than ``lmrl.algos.registry.Registry``, because this
module is what reward worker processes import and ``lmrl.algos`` imports torch (a second and
~150 MB per worker, again at every replacement of a hung one).

`default_compute_score` has verl's reward-function signature and dispatches on
``data_source``; `BuiltinScorer` is the same with per-source options (``{"gsm8k": {"method":
"flexible"}}``), picklable so that reward worker processes can rebuild it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from lmrl.rewards.scorers import (
    countdown,
    digits,
    gsm8k,
    knights_knaves,
    math_boxed,
    qa_em,
    small_tasks,
)

Scorer = Callable[..., float | dict]

# data_source names -> scorer; the first name of each row is ours.
_NAMES: tuple[tuple[tuple[str, ...], Scorer], ...] = (
    (("gsm8k", "arithmetic", "openai/gsm8k"), gsm8k.compute_score),
    (
        (
            "math",
            "lighteval/MATH",
            "DigitalLearningGmbH/MATH-lighteval",
            "HuggingFaceH4/MATH-500",
        ),
        math_boxed.compute_score,
    ),
    (("countdown",), countdown.compute_score),
    (("knights_knaves", "kk_logic"), knights_knaves.compute_score),
    (("digits",), digits.compute_score),
    (("count",), small_tasks.count_score),
    (("sort",), small_tasks.sort_score),
    (("add",), small_tasks.add_score),
    (("compare",), small_tasks.compare_score),
    # Search-R1's QA sets, and our search_qa task: exact match on the <answer>
    (
        (
            "search_qa",
            "nq",
            "triviaqa",
            "popqa",
            "hotpotqa",
            "2wikimultihopqa",
            "musique",
            "bamboogle",
        ),
        qa_em.compute_score,
    ),
)
SCORERS: Mapping[str, Scorer] = MappingProxyType(
    {name: fn for names, fn in _NAMES for name in names}
)


def get_scorer(data_source: str) -> Scorer:
    """The built-in scorer of ``data_source``.

    Raises:
        ValueError: no scorer has that name (the message lists the valid names).
    """
    try:
        return SCORERS[data_source]
    except (KeyError, TypeError):
        names = ", ".join(sorted(SCORERS))
        raise ValueError(f"unknown data_source {data_source!r}; valid names: {names}") from None


def _scorer_with_truth(data_source: str, ground_truth: Any) -> Scorer:
    fn = get_scorer(data_source)
    if ground_truth is None:
        raise ValueError(
            f"no ground truth for data_source {data_source!r}: the built-in scorer needs the "
            "row's reward_model.ground_truth"
        )
    return fn


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float | dict:
    """Score one response with the built-in scorer of its ``data_source`` (verl's signature).

    Raises:
        ValueError: no scorer is registered for ``data_source`` (the message lists them), or
            ``ground_truth`` is None.
    """
    return _scorer_with_truth(data_source, ground_truth)(solution_str, ground_truth, extra_info)


def scorer_option_errors(options: Mapping[str, Any]) -> list[str]:
    """What is wrong with ``reward.scorer_options`` (``{data_source: {option: value}}``): a
    data source no built-in scorer has, or an option its scorer does not take. Empty = fine.
    """
    import inspect

    errors = []
    for source, kwargs in options.items():
        if source not in SCORERS:
            errors.append(
                f"reward.scorer_options.{source}: no built-in scorer has that data_source; "
                f"valid names: {', '.join(sorted(SCORERS))}"
            )
            continue
        fixed = ("solution_str", "ground_truth", "extra_info")
        known = [p for p in inspect.signature(SCORERS[source]).parameters if p not in fixed]
        errors += [
            f"reward.scorer_options.{source}.{key}: the {source} scorer has no option "
            f"{key!r}; its options: {', '.join(known) or 'none'}"
            for key in (kwargs if isinstance(kwargs, Mapping) else {})
            if key not in known
        ]
    return errors


class BuiltinScorer:
    """`default_compute_score` with keyword options per data source.

    Args:
        options: ``{data_source: {option: value}}``, e.g. ``{"gsm8k": {"method": "flexible"}}``
            or ``{"countdown": {"format_score": 0.0}}``; each key must be a registered name.

    Raises:
        ValueError: an unknown data source in ``options``.
    """

    def __init__(self, options: Mapping[str, Mapping[str, Any]] | None = None):
        self.options = {str(k): dict(v) for k, v in (options or {}).items()}
        for name in self.options:
            get_scorer(name)

    def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> float | dict:
        fn = _scorer_with_truth(data_source, ground_truth)
        return fn(solution_str, ground_truth, extra_info, **self.options.get(data_source, {}))

    def __repr__(self) -> str:
        return f"BuiltinScorer({self.options})"


__all__ = [
    "SCORERS",
    "BuiltinScorer",
    "Scorer",
    "default_compute_score",
    "get_scorer",
    "scorer_option_errors",
]
