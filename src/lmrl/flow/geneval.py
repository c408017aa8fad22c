"""The GenEval-like rule reward: a small deterministic detector of coloured objects, and the
checks of a prompt's objects it can judge.

**The detector** (`find_objects`) reads a ``shapes`` image as the renderer draws it: a pixel is
an object's when its brightest channel is above 0.35 and leads the next by 0.25 (its colour is
that channel); objects are the 4-connected regions of one colour (labels propagated to the
largest id of the region, all images at once), at least ``min_area`` pixels. An object's shape
is read from how much of its bounding box it fills: a square fills it (>= 0.93), a disc about
0.8, a triangle about 0.5 (< 0.7).

**The checks** (each 0 or 1 per image; the score is their mean, ``strict``: their minimum) come
from the prompt's metadata, in one of two forms:

- a ``shapes`` prompt's attributes ``{shape, colour, count, position}``: colour (an object of
  the prompt's colour exists), count (exactly that many of that colour), shape (all of them
  have the prompt's shape) and position (all of them lie in the prompt's half);
- a GenEval row (Flow-GRPO's ``train_metadata.jsonl``: ``include`` = [{``class``, ``count``,
  ``color``?, ``position``? = [relation, index]}]): each included object is checked where the
  detector can judge it. Its colour when it is one the detector reads (red, green, blue); its
  count among the objects of that colour (or of that shape); its class when it is a shape
  (circle, square, triangle: all objects of its colour have it); its position relative to the
  object ``index`` (``left of``, ``right of``, ``above``, ``below``, by the mean centroids)
  when both can be found. An object class such as ``dog`` or a colour such as ``yellow`` is not
  judged (`geneval_coverage` names them, and the run says so once); a check of an image is the
  minimum over its objects' judged checks, NaN when none was judged; an image with no judged
  check scores 0 (all such images of a prompt score alike, so they teach nothing).

A GenEval metadata file is checked as it is read (`check_geneval_rows`): every row has an
``include`` list of objects with a ``class`` string and a whole ``count`` >= 1 (``2``, not
``"two"``), a ``color`` string and a ``position`` ``[relation, index of another object]``
where given, and no other keys; a bad row is a data error naming the file, line and field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmrl.data.shapes import COLOURS, SHAPES
from lmrl.errors import DataError

__all__ = [
    "CHECKS",
    "Coverage",
    "DetectedObject",
    "check_geneval_rows",
    "find_objects",
    "geneval",
    "geneval_checks",
    "geneval_coverage",
    "geneval_row_problem",
    "geneval_scores",
    "include_checks",
]

CHECKS = ("colour", "count", "shape", "position")
_CHANNEL_COLOUR = {channel: name for name, (channel, _) in COLOURS.items()}
_RELATIONS = ("left of", "right of", "above", "below")
ATTRIBUTE_KEYS = ("shape", "colour", "count", "position")  # a shapes prompt's attributes
# the keys of an object of a GenEval row's ``include`` list (``exclude`` holds class and count)
INCLUDE_KEYS = ("class", "count", "color", "position")
GENEVAL_FORMAT = (
    'GenEval\'s format: "include": [{"class": "dog", "count": 2, "color"?: "red", '
    '"position"?: ["left of", 0]}]'
)


@dataclass(frozen=True)
class DetectedObject:
    """One object: its colour, shape, area (pixels) and centroid (x, y) in pixels."""

    colour: str
    shape: str
    area: int
    centroid: tuple[float, float]


def _labels(colour: torch.Tensor) -> torch.Tensor:
    """(B, H, W) long colour ids (-1 = background) -> region labels (0 = background)."""
    b, h, w = colour.shape
    fg = colour >= 0
    labels = torch.where(fg, torch.arange(1, h * w + 1).view(1, h, w).expand(b, h, w), 0)
    while True:
        best = labels.clone()
        for dy, dx in ((0, 1), (0, -1), (1, 0), (-1, 0)):
            shifted = torch.zeros_like(labels)
            same = torch.zeros_like(fg)
            ys, yd = slice(max(dy, 0), h + min(dy, 0)), slice(max(-dy, 0), h + min(-dy, 0))
            xs, xd = slice(max(dx, 0), w + min(dx, 0)), slice(max(-dx, 0), w + min(-dx, 0))
            shifted[:, yd, xd] = labels[:, ys, xs]
            same[:, yd, xd] = colour[:, ys, xs] == colour[:, yd, xd]
            best = torch.where(fg & same, torch.maximum(best, shifted), best)
        if torch.equal(best, labels):
            return labels
        labels = best


def _shape(fill: float) -> str:
    if fill >= 0.93:
        return "square"
    return "circle" if fill >= 0.7 else "triangle"


def find_objects(images: torch.Tensor, min_area: int = 4) -> list[list[DetectedObject]]:
    """The coloured objects of each image (B, 3, H, W) in [0, 1] (see the module docstring)."""
    img = images.detach().float().clamp(0, 1).cpu()
    top2 = img.topk(2, dim=1).values
    colour = torch.where((top2[:, 0] > 0.35) & (top2[:, 0] - top2[:, 1] > 0.25), img.argmax(1), -1)
    labels = _labels(colour)
    found: list[list[DetectedObject]] = []
    for i in range(img.shape[0]):
        objects = []
        for label in labels[i].unique().tolist():
            if label == 0:
                continue
            ys, xs = torch.nonzero(labels[i] == label, as_tuple=True)
            area = len(ys)
            if area < min_area:
                continue
            box = (int(ys.max() - ys.min()) + 1) * (int(xs.max() - xs.min()) + 1)
            name = _CHANNEL_COLOUR[int(colour[i, ys[0], xs[0]])]
            centre = (float(xs.float().mean()) + 0.5, float(ys.float().mean()) + 0.5)
            objects.append(DetectedObject(name, _shape(area / box), area, centre))
        found.append(objects)
    return found


def _in_half(centroid: tuple[float, float], position: str, size: int) -> bool:
    x, y = centroid
    half = size / 2
    return {"left": x < half, "right": x > half, "top": y < half, "bottom": y > half}[position]


def geneval_checks(objects: list[DetectedObject], spec: dict, size: int) -> dict[str, float]:
    """The four checks of one image against its prompt's attributes, each 0.0 or 1.0."""
    mine = [o for o in objects if o.colour == spec["colour"]]
    want = 2 if spec["count"] == "two" else 1
    return {
        "colour": float(bool(mine)),
        "count": float(len(mine) == want),
        "shape": float(bool(mine) and all(o.shape == spec["shape"] for o in mine)),
        "position": float(
            bool(mine) and all(_in_half(o.centroid, spec["position"], size) for o in mine)
        ),
    }


def _of(objects: list[DetectedObject], entry: dict) -> list[DetectedObject] | None:
    """The detected objects an ``include`` entry names (its colour's, else its shape's), or
    None when the detector cannot tell which they are."""
    colour, kind = entry.get("color"), entry.get("class")
    if colour in COLOURS:
        return [o for o in objects if o.colour == colour]
    if kind in SHAPES:
        return [o for o in objects if o.shape == kind]
    return None


def _centre(objects: list[DetectedObject]) -> tuple[float, float]:
    return (
        sum(o.centroid[0] for o in objects) / len(objects),
        sum(o.centroid[1] for o in objects) / len(objects),
    )


def _relation(mine: list[DetectedObject], other: list[DetectedObject], relation: str) -> bool:
    if not mine or not other:
        return False
    (x, y), (ox, oy) = _centre(mine), _centre(other)
    return {"left of": x < ox, "right of": x > ox, "above": y < oy, "below": y > oy}[relation]


def include_checks(objects: list[DetectedObject], include: Sequence[dict]) -> dict[str, float]:
    """The checks of one image against a GenEval row's ``include`` list: each of `CHECKS`
    1.0 when every judged object passes it, 0.0 when one fails, NaN when none was judged."""
    found = [_of(objects, entry) for entry in include]
    results: dict[str, list[bool]] = {key: [] for key in CHECKS}
    for entry, mine in zip(include, found, strict=True):
        if mine is None:
            continue
        if entry.get("color") in COLOURS:
            results["colour"].append(bool(mine))
            if entry.get("class") in SHAPES:
                results["shape"].append(bool(mine) and all(o.shape == entry["class"] for o in mine))
        if "count" in entry:
            results["count"].append(len(mine) == int(entry["count"]))
        position = entry.get("position")
        if position and position[0] in _RELATIONS and 0 <= int(position[1]) < len(found):
            other = found[int(position[1])]
            if other is not None:
                results["position"].append(_relation(mine, other, position[0]))
    return {k: float(all(v)) if v else float("nan") for k, v in results.items()}


def _checks(objects: list[DetectedObject], spec: Any, size: int) -> dict[str, float]:
    """The checks of one image: a GenEval row's, a shapes prompt's, or none (all NaN: a prompt
    with nothing to judge, such as a text prompt's empty metadata, which `geneval_coverage`
    counts and the run names)."""
    if isinstance(spec, dict) and "include" in spec:
        return include_checks(objects, spec["include"])
    if isinstance(spec, dict) and all(k in spec for k in ATTRIBUTE_KEYS):
        return geneval_checks(objects, spec, size)
    return dict.fromkeys(CHECKS, math.nan)


def geneval_scores(
    images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict], strict: bool = False
) -> dict[str, torch.Tensor]:
    """GenEval-like rule reward with its checks: ``{"score": (B,), "colour": (B,), ...}``; the
    score is the mean of the judged checks (``strict``: their minimum), 0 with none judged."""
    size = images.shape[-1]
    rows = [
        _checks(objects, spec, size)
        for objects, spec in zip(find_objects(images), metadata, strict=True)
    ]
    checks = {key: torch.tensor([r[key] for r in rows]) for key in CHECKS}
    if not rows:
        return {"score": torch.zeros(0), **checks}
    table = torch.stack([checks[key] for key in CHECKS], 1)
    judged = table.isfinite()
    if strict:
        score = torch.where(judged, table, torch.ones_like(table)).amin(1)
    else:
        score = table.nan_to_num(0.0).sum(1) / judged.sum(1).clamp(min=1)
    return {"score": torch.where(judged.any(1), score, torch.zeros_like(score)), **checks}


def geneval(
    images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict], strict: bool = False
) -> torch.Tensor:
    """GenEval-like rule reward: (B,) mean of the judged checks (``strict``: all of them)."""
    return geneval_scores(images, prompts, metadata, strict)["score"]


@dataclass
class Coverage:
    """What `geneval_scores` can judge of a set of prompts (`geneval_coverage`).

    Attributes:
        judged: prompts with at least one check it can judge.
        total: prompts.
        classes: object classes it cannot judge (not a shape).
        colours: colours it cannot judge (not red, green or blue).
    """

    judged: int
    total: int
    classes: set[str] = field(default_factory=set)
    colours: set[str] = field(default_factory=set)

    def message(self) -> str | None:
        """One line naming what is not judged, or None when everything is."""
        if self.judged == self.total and not self.classes and not self.colours:
            return None
        parts = []
        if self.classes:
            parts.append(
                f"object classes ({_few(self.classes)}: it reads only {', '.join(SHAPES)})"
            )
        if self.colours:
            parts.append(f"colours ({_few(self.colours)}: it reads only {', '.join(COLOURS)})")
        unjudged = self.total - self.judged
        return (
            f"the geneval detector cannot judge {' or '.join(parts) or 'these prompts'}; it "
            f"checks the rest of each prompt"
            + (f", and {unjudged} of {self.total} prompts have nothing it can judge (their "
               "images score 0 and teach nothing)" if unjudged else "")
        )  # fmt: skip


def _few(names: set[str], most: int = 6) -> str:
    shown = sorted(names)[:most]
    return ", ".join(shown) + (f" and {len(names) - most} more" if len(names) > most else "")


def geneval_coverage(metadata: Sequence[dict]) -> Coverage:
    """Which of the prompts' checks the detector can judge (see the module docstring)."""
    coverage = Coverage(0, len(metadata))
    for spec in metadata:
        if not isinstance(spec, dict):
            continue
        if "include" not in spec:
            coverage.judged += all(k in spec for k in ATTRIBUTE_KEYS)
            continue
        judged = False
        for entry in spec["include"]:
            colour, kind = entry.get("color"), entry.get("class")
            if colour is not None and colour not in COLOURS:
                coverage.colours.add(str(colour))
            if kind not in SHAPES:
                coverage.classes.add(str(kind))
            judged |= colour in COLOURS or kind in SHAPES
        coverage.judged += judged
    return coverage


def _objects_problem(value: Any, key: str, keys: Sequence[str]) -> str | None:
    """The first problem of a row's list ``key`` of objects ``{class, count, ...}`` (its
    shape, its classes and counts; not the other fields' values), or None."""
    if not isinstance(value, list) or not value:
        return f"{key}={value!r:.60} must be a non-empty list of objects"
    for j, entry in enumerate(value):
        if not isinstance(entry, dict):
            return f"{key}[{j}]={entry!r:.60} must be an object"
        unknown = ", ".join(map(repr, sorted(set(entry) - set(keys))))
        if unknown:
            return f"{key}[{j}] has {unknown}: its keys are {', '.join(keys)}"
        kind, count = entry.get("class"), entry.get("count")
        if not isinstance(kind, str) or not kind:
            return f'{key}[{j}].class={kind!r:.40} must be an object class such as "dog"'
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            return f'{key}[{j}].count={count!r:.40} must be a whole number >= 1 (2, not "two")'
    return None


def geneval_row_problem(row: dict) -> str | None:
    """What is wrong with one GenEval metadata row (Flow-GRPO's ``train_metadata.jsonl``), as a
    phrase naming the field and its value, or None: ``include`` a non-empty list of objects
    ``{class: str, count: int >= 1, color?: str, position?: [relation, index]}`` (a relation
    of `_RELATIONS`, the index of another object of the list); ``exclude``, when present, a
    list of ``{class, count}``."""
    if "include" not in row:
        return "no include (every row of a GenEval metadata file lists the objects it includes)"
    include = row["include"]
    problem = _objects_problem(include, "include", INCLUDE_KEYS)
    if problem is not None:
        return problem
    for j, entry in enumerate(include):
        colour = entry.get("color")
        if "color" in entry and (not isinstance(colour, str) or not colour):
            return f'include[{j}].color={colour!r:.40} must be a colour name such as "red"'
        position = entry.get("position")
        if "position" not in entry:
            continue
        if (
            not isinstance(position, list)
            or len(position) != 2
            or position[0] not in _RELATIONS
            or isinstance(position[1], bool)
            or not isinstance(position[1], int)
            or not 0 <= position[1] < len(include)
            or position[1] == j
        ):
            return (
                f"include[{j}].position={position!r:.60} must be [relation, index]: a relation "
                f"of {', '.join(map(repr, _RELATIONS))} and the index of another object of "
                f"include (0..{len(include) - 1})"
            )
    if "exclude" in row:
        return _objects_problem(row["exclude"], "exclude", ("class", "count"))
    return None


def check_geneval_rows(file: object, rows: Sequence[tuple[int, dict]]) -> None:
    """Refuse a GenEval metadata file with a malformed row, as it is read: a file is GenEval's
    when one of its rows has ``include``, and then every row must be one
    (`geneval_row_problem`).

    Args:
        file: names the file in the message.
        rows: ``(line number, row)`` of each row.

    Raises:
        DataError: one line naming the file, the line and the field.
    """
    if not any(isinstance(row, dict) and "include" in row for _, row in rows):
        return
    for line, row in rows:
        problem = geneval_row_problem(row)
        if problem is not None:
            raise DataError(f"{file} line {line}: {problem} ({GENEVAL_FORMAT})")
