"""Image rewards a user can read: a GenEval-like rule reward with a small deterministic
detector, simple image statistics, and the user's own functions from a file.

Every reward is ``fn(images, prompts, metadata) -> scores``: ``images`` a float tensor
(B, 3, H, W) in [0, 1], ``prompts`` the B prompt strings, ``metadata`` B dicts (a shapes
prompt's attributes), returning B floats (a list, array or tensor), or a dict of such columns
holding ``"score"`` and per-image values the run logs beside it (the built-in ``geneval``
returns its four checks so, and the run logs their means without detecting anything twice).

**geneval** and **geneval_strict** are `lmrl.flow.geneval`'s rule reward (a detector of coloured
objects and the checks of a prompt's attributes or GenEval metadata it can judge).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmrl._userfile import UserFileError, import_user_file
from lmrl.data.shapes import png_bytes
from lmrl.errors import RewardError
from lmrl.flow.geneval import (
    DetectedObject,
    find_objects,
    geneval,
    geneval_checks,
    geneval_scores,
)

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
