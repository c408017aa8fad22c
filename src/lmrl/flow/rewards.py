"""Image rewards a user can read: a GenEval-like rule reward with a small deterministic
detector, simple image statistics, and the user's own functions from a file.

Every reward is ``fn(images, prompts, metadata) -> scores``: ``images`` a float tensor
(B, 3, H, W) in [0, 1], ``prompts`` the B prompt strings, ``metadata`` B dicts (a shapes
prompt's attributes), returning B floats (a list, array or tensor), or a dict of such columns
holding ``"score"`` and per-image values the run logs beside it (the built-in ``geneval``
returns its four checks so, and the run logs their means without detecting anything twice).

**The detector** (`find_objects`) reads a ``shapes`` image as the renderer draws it: a pixel is
an object's when its brightest channel is above 0.35 and leads the next by 0.25 (its colour is
that channel); objects are the 4-connected regions of one colour (labels propagated to the
largest id of the region, all images at once), at least ``min_area`` pixels. An object's shape
is read from how much of its bounding box it fills: a square fills it (>= 0.93), a disc about
0.8, a triangle about 0.5 (< 0.7).

**geneval** scores the four checks of a prompt, each 0 or 1, averaged (``strict``: 1 only when
all hold): colour (an object of the prompt's colour exists), count (exactly that many of that
colour), shape (all of them have the prompt's shape) and position (all of them lie in the
prompt's half).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmrl._userfile import UserFileError, import_user_file
from lmrl.data.shapes import COLOURS, png_bytes
from lmrl.errors import RewardError

__all__ = [
    "IMAGE_REWARDS",
    "DetectedObject",
    "ImageReward",
    "find_objects",
    "geneval",
    "geneval_checks",
    "geneval_scores",
    "load_image_reward",
]

log = logging.getLogger("lmrl.rewards")
ImageRewardFn = Callable[[torch.Tensor, Sequence[str], Sequence[dict]], Any]
_CHANNEL_COLOUR = {channel: name for name, (channel, _) in COLOURS.items()}


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


def geneval_scores(
    images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict], strict: bool = False
) -> dict[str, torch.Tensor]:
    """GenEval-like rule reward with its checks: ``{"score": (B,), "colour": (B,), ...}``; the
    score is the mean of the four checks (``strict``: their minimum)."""
    size = images.shape[-1]
    rows = [geneval_checks(o, s, size) for o, s in zip(find_objects(images), metadata, strict=True)]
    checks = {key: torch.tensor([r[key] for r in rows]) for key in rows[0]} if rows else {}
    table = torch.stack(list(checks.values()), 1) if rows else torch.zeros(0, 4)
    score = table.amin(1) if strict else table.mean(1)
    return {"score": score, **checks}


def geneval(
    images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict], strict: bool = False
) -> torch.Tensor:
    """GenEval-like rule reward: (B,) mean of the four checks (``strict``: all of them)."""
    return geneval_scores(images, prompts, metadata, strict)["score"]


def brightness(images: torch.Tensor, prompts=None, metadata=None) -> torch.Tensor:
    """Mean pixel value, (B,) in [0, 1]."""
    return images.float().clamp(0, 1).mean((1, 2, 3))


def colourfulness(images: torch.Tensor, prompts=None, metadata=None) -> torch.Tensor:
    """Hasler and Suesstrunk's colourfulness, (B,) >= 0 (0 for any grey image): with the
    opponent channels ``rg = R - G`` and ``yb = (R + G) / 2 - B`` over the pixels,
    ``sqrt(std(rg)^2 + std(yb)^2) + 0.3 sqrt(mean(rg)^2 + mean(yb)^2)`` (population std)."""
    x = images.float().clamp(0, 1)
    r, g, b = x[:, 0].flatten(1), x[:, 1].flatten(1), x[:, 2].flatten(1)
    rg, yb = r - g, (r + g) / 2 - b
    spread = (rg.var(1, correction=0) + yb.var(1, correction=0)).sqrt()
    return spread + 0.3 * (rg.mean(1) ** 2 + yb.mean(1) ** 2).sqrt()


def compressibility(images: torch.Tensor, prompts=None, metadata=None) -> torch.Tensor:
    """Minus the PNG size in bits per pixel (an image that compresses well scores higher)."""
    out = []
    for img in images.detach().float().cpu():
        size = len(png_bytes(img.permute(1, 2, 0).numpy(), optimize=True))
        out.append(-8.0 * size / (img.shape[1] * img.shape[2]))
    return torch.tensor(out)


IMAGE_REWARDS: dict[str, ImageRewardFn] = {
    "geneval": geneval_scores,
    "geneval_strict": partial(geneval_scores, strict=True),
    "brightness": brightness,
    "colourfulness": colourfulness,
    "compressibility": compressibility,
}


class ImageReward:
    """A reward function with its output checked, failing like a text reward does.

    ``reward.score(images, prompts, metadata)`` returns the (B,) float scores, the per-image
    values a function may return beside them (``{"score": ..., "shape": ...}``: the geneval
    checks) and counters. A function that raises, or returns no B numbers (a wrong length,
    strings, None), fails on every image of the batch; a NaN or infinite score fails that
    image. A failed image scores 0 and counts in ``reward/errors`` (out of ``reward/scored``);
    the first failure is logged once. On the first call, failing on at least
    ``max_error_fraction`` of the images raises `RewardError` quoting the first error, so a
    broken reward stops a run at its first step instead of training on zeros.

    Args:
        fn: ``fn(images, prompts, metadata) -> scores``.
        label: names the function in messages (``reward_fn in /path/reward.py``).
        max_error_fraction: as the text rewards' ``reward.max_error_fraction``; > 1 = never.
    """

    def __init__(self, fn: ImageRewardFn, label: str, max_error_fraction: float = 0.9) -> None:
        self.fn, self.label = fn, label
        self.max_error_fraction = max_error_fraction
        self.calls = 0  # batches scored so far; the error threshold applies to the first
        self._logged = False

    def _numbers(self, values: Any, what: str, count: int) -> torch.Tensor | str:
        """``values`` as (count,) float32, or why not (non-finite entries are kept)."""
        if isinstance(values, torch.Tensor):
            values = values.detach().float().cpu().numpy()
        try:
            array = np.asarray(values)
        except (TypeError, ValueError) as err:  # ragged lists
            return f"returned {what} that are not one array ({err})"
        if array.dtype.kind not in "biuf":  # strings, None, objects: never converted
            first = array.flat[0] if array.size else values
            first = first.item() if isinstance(first, np.generic) else first
            kind = "strings" if isinstance(first, str | bytes) else type(first).__name__
            return f"returned {what} as {kind} ({first!r:.40}), expected numbers"
        if array.shape != (count,):
            return f"returned {what} of shape {array.shape}, expected ({count},)"
        return torch.as_tensor(array.astype(np.float32))

    def _call(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]
    ) -> tuple[torch.Tensor | str, dict[str, torch.Tensor]]:
        """The scores (or why the whole batch failed) and the valid extra columns."""
        count = images.shape[0]
        try:
            out = self.fn(images, prompts, metadata)
        except Exception as err:
            first_line = (str(err).splitlines() or [""])[0]
            return f"raised {type(err).__name__}: {first_line}", {}
        if not isinstance(out, dict):
            return self._numbers(out, "scores", count), {}
        if "score" not in out:
            return f"returned a dict without 'score' (keys {sorted(map(str, out))})", {}
        extras = {}
        for key, value in out.items():
            column = self._numbers(value, f"{key!r} values", count) if key != "score" else None
            if isinstance(column, torch.Tensor):
                extras[str(key)] = column
            elif column is not None:
                self._warn(f"its {column}; the values are not logged")
        return self._numbers(out["score"], "scores", count), extras

    def _warn(self, message: str) -> None:
        if not self._logged:
            self._logged = True
            log.warning("image reward %s %s (logged once)", self.label, message)

    def score(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
        """Score B images.

        Returns:
            ``(scores (B,) float32, {name: (B,)} values beside the score, metrics)``, the
            metrics ``reward/scored`` (B) and ``reward/errors``; a failed image scores 0.

        Raises:
            RewardError: on the first call, failures on at least ``max_error_fraction`` of
                the images (one line quoting the first error).
        """
        count = images.shape[0]
        scores, extras = self._call(images, prompts, metadata)
        if isinstance(scores, str):
            failed, first = count, scores
            scores = torch.zeros(count)
        else:
            bad = ~torch.isfinite(scores)
            failed = int(bad.sum())
            first = (
                f"returned a non-finite score {scores[bad][0].item()} for image "
                f"{int(bad.nonzero()[0])} of {count}"
                if failed
                else ""
            )
            scores = torch.where(bad, torch.zeros_like(scores), scores)
        calls, self.calls = self.calls, self.calls + 1
        if failed and calls == 0 and failed >= self.max_error_fraction * count:
            raise RewardError(
                f"image reward {self.label} failed on {failed} of {count} images of the first "
                f"batch; first error: it {first}. Fix the reward, or set "
                f"reward.max_error_fraction above {self.max_error_fraction:g} (> 1 = never "
                "stop) to train on anyway"
            )
        if failed:
            self._warn(f"{first} (scored 0 and counted in reward/errors)")
        return scores, extras, {"reward/scored": float(count), "reward/errors": float(failed)}

    def __call__(self, images, prompts, metadata) -> torch.Tensor:
        return self.score(images, prompts, metadata)[0]


def load_image_reward(
    name: str | None = None, path: str | Path | None = None, max_error_fraction: float = 0.9
) -> ImageReward:
    """A built-in image reward by name, or the function ``name`` (default ``reward_fn``) of
    the user's file ``path``, as an `ImageReward` (``max_error_fraction``: see there).

    Raises:
        RewardError: an unknown name, a file that is missing or fails to import, a missing
            function, or one that cannot take ``(images, prompts, metadata)``.
    """
    if path is None:
        if name not in IMAGE_REWARDS:
            raise RewardError(
                f"unknown image reward {name!r}; built in: {', '.join(IMAGE_REWARDS)} (or give "
                "a file of your own)"
            )
        return ImageReward(IMAGE_REWARDS[name], name, max_error_fraction)
    name = name or "reward_fn"
    try:
        module = import_user_file(path, "lmrl_user_image_reward")
    except UserFileError as err:
        raise RewardError(f"image reward file {path} {err}") from err.__cause__
    fn = getattr(module, name, None)
    if not callable(fn):
        mine = [
            k for k, v in vars(module).items()
            if inspect.isfunction(v) and v.__module__ == module.__name__ and not k.startswith("_")
        ]  # fmt: skip
        default = " (the built-in default; set reward.name)" if name in IMAGE_REWARDS else ""
        raise RewardError(
            f"image reward file {path} has no function {name!r}{default}; its functions: "
            f"{', '.join(mine) or 'none'}"
        )
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): found on the first call
        signature = None
    if signature is not None:
        try:
            signature.bind(None, None, None)
        except TypeError as err:
            raise RewardError(
                f"image reward file {path}: {name}{signature} cannot be called as "
                f"{name}(images, prompts, metadata) ({err})"
            ) from None
    return ImageReward(fn, f"{name} in {path}", max_error_fraction)
