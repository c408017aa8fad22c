"""Exact match on the ``<answer>`` of a question-answering response (Search-R1's reward).

The answer is the text of the last complete ``<answer>...</answer>`` of the response; it
matches when, normalized as SQuAD and Search-R1 normalize (lowercase, punctuation removed,
the articles a/an/the removed, whitespace collapsed), it equals one of the ground truths
normalized the same way. Ground truths come as Search-R1 stores them
(``{"target": [...]}``), as a list, or as one string.

Scores: 1.0 for a match; otherwise the largest of three optional credits (all 0 by
default, which is Search-R1's exact match): ``format_score`` for a well-formed answer,
``partial`` times the share of the answer's characters in place (against the closest ground
truth: dense credit for a tiny model learning to copy), and ``retrieval_score`` when a ground
truth appears in a retrieved ``<information>`` block (the search found it; R1-Searcher's
retrieval reward). No answer scores at most the retrieval credit. ``acc`` is the match itself.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

from lmrl.rewards.scorers._text import cut_at_end_marker, last_tag_content
from lmrl.rewards.scorers.small_tasks import positional_credit

__all__ = ["compute_score", "normalize_answer", "truths"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
_INFORMATION = re.compile(r"<information>(.*?)</information>", re.S)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace."""
    text = str(text).lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def truths(ground_truth: Any) -> list[str]:
    """The accepted answers of a ground truth: ``{"target": [...]}``, a list, or a string.

    Raises:
        ValueError: none given (an empty list, a dict without ``target``).
    """
    if isinstance(ground_truth, Mapping):
        if "target" not in ground_truth:
            raise ValueError(
                f"a QA ground truth dict needs 'target' (the answers), got keys {sorted(ground_truth)}"
            )
        ground_truth = ground_truth["target"]
    if isinstance(ground_truth, str):
        out = [ground_truth]
    elif isinstance(ground_truth, Sequence) or hasattr(ground_truth, "tolist"):
        out = [
            str(t)
            for t in (ground_truth.tolist() if hasattr(ground_truth, "tolist") else ground_truth)
        ]
    else:
        out = [str(ground_truth)]
    if not out:
        raise ValueError("a QA ground truth needs at least one answer")
    return out


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    format_score: float = 0.0,
    partial: float = 0.0,
    retrieval_score: float = 0.0,
) -> dict:
    """``{"score", "acc"}`` of one response (see the module docstring)."""
    answers = {normalize_answer(t) for t in truths(ground_truth)}
    text = cut_at_end_marker(solution_str)
    answer = last_tag_content(text, "answer")
    retrieved = 0.0
    if retrieval_score:
        found = " ".join(normalize_answer(b) for b in _INFORMATION.findall(text))
        if any(a and f" {a} " in f" {found} " for a in answers):
            retrieved = float(retrieval_score)
    if answer is None:
        return {"score": retrieved, "acc": 0.0}
    pred = normalize_answer(answer)
    if pred in answers:
        return {"score": 1.0, "acc": 1.0}
    credit = max(positional_credit(pred, a) for a in answers) * partial if partial else 0.0
    return {"score": max(float(format_score), credit, retrieved), "acc": 0.0}
