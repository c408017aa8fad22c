"""The ``shapes`` task: prompts like "two red circles on the left" and small images of them.

A prompt has four attributes: a shape (square, circle, triangle), a colour (red, green,
blue), a count (one, two) and a position (the left, right, top or bottom half). `render`
draws it on a black ``size x size`` RGB image (16 by default): shapes of 5-6 pixels, the
colour's channel high and the others low with a little jitter, placed at random inside the
half (two of them side by side along the half's long side). `write_images` writes the
pre-training set (``images.parquet``: PNG bytes and the attributes) that the flow model
learns by flow matching before Flow-GRPO; the prompt splits (``train``/``test``) carry the
attributes as the ground truth a detector checks (`lmrl.flow.rewards`).

The conditioning a model sees is `attribute_vector`: a multi-hot vector over the 12 attribute
values (all zeros = unconditional, for classifier-free guidance). `noisy_captions` loosens the
captions a model is pre-trained on (as web alt-text is loose), so that it draws well but follows
its prompts only in part: the starting point of GenEval's RL, and of the image demo's.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "ATTRIBUTES",
    "COLOURS",
    "NUM_ATTRIBUTES",
    "attribute_vector",
    "generate",
    "noisy_captions",
    "png_bytes",
    "prompt_text",
    "random_spec",
    "read_images",
    "render",
    "write_images",
]

SHAPES = ("square", "circle", "triangle")
COLOURS = {"red": (0, 0.9), "green": (1, 0.9), "blue": (2, 0.9)}  # channel, intensity
COUNTS = ("one", "two")
POSITIONS = ("left", "right", "top", "bottom")
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "shape": SHAPES,
    "colour": tuple(COLOURS),
    "count": COUNTS,
    "position": POSITIONS,
}
NUM_ATTRIBUTES = sum(len(v) for v in ATTRIBUTES.values())


def random_spec(rng: random.Random) -> dict[str, str]:
    """One prompt's attributes, uniform over the 72 combinations."""
    return {key: rng.choice(values) for key, values in ATTRIBUTES.items()}


def prompt_text(spec: dict[str, str]) -> str:
    """``"two red circles on the left"``, ``"one blue square at the top"``."""
    noun = spec["shape"] + ("s" if spec["count"] == "two" else "")
    where = {"left": "on the left", "right": "on the right", "top": "at the top",
             "bottom": "at the bottom"}[spec["position"]]  # fmt: skip
    return f"{spec['count']} {spec['colour']} {noun} {where}"


def attribute_vector(spec: dict[str, Any]) -> np.ndarray:
    """The multi-hot (12,) float32 vector of a spec (shape, colour, count, position)."""
    out, at = np.zeros(NUM_ATTRIBUTES, dtype=np.float32), 0
    for key, values in ATTRIBUTES.items():
        out[at + values.index(spec[key])] = 1.0
        at += len(values)
    return out


def _shape_mask(shape: str, side: int) -> np.ndarray:
    """A ``side x side`` bool mask: a full square, a disc, or a triangle (apex up)."""
    yy, xx = np.mgrid[0:side, 0:side] + 0.5
    if shape == "square":
        return np.ones((side, side), dtype=bool)
    if shape == "circle":
        r = side / 2
        return (yy - r) ** 2 + (xx - r) ** 2 <= r * r
    # triangle: the half-width grows from 0 at the top row to side/2 at the bottom
    return np.abs(xx - side / 2) <= yy / 2


def noisy_captions(
    specs: list[dict[str, str]], noise: float, seed: int = 0
) -> list[dict[str, str]]:
    """The captions a model is pre-trained on when they are as loose as web alt-text: each
    attribute of each caption is, with probability ``noise``, drawn anew uniformly from its
    values (so it stays right with probability ``1 - noise + noise / len(values)``); the
    images are unchanged. The same ``specs``, ``noise`` and ``seed`` give the same captions.

    Raises:
        ValueError: ``noise`` outside [0, 1].
    """
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"caption noise must be in [0, 1], got {noise}")
    rng = random.Random(f"shapes-captions-{seed}")
    out = []
    for spec in specs:
        caption = dict(spec)
        for key, values in ATTRIBUTES.items():
            if rng.random() < noise:
                caption[key] = rng.choice(values)
        out.append(caption)
    return out


def render(spec: dict[str, str], rng: random.Random, size: int = 16) -> np.ndarray:
    """The image of ``spec``: (size, size, 3) float32 in [0, 1] (see the module docstring)."""
    img = np.zeros((size, size, 3), dtype=np.float32)
    half = size // 2
    x0, y0, w, h = {"left": (0, 0, half, size), "right": (half, 0, half, size),
                    "top": (0, 0, size, half), "bottom": (0, half, size, half)}[spec["position"]]  # fmt: skip
    n = 2 if spec["count"] == "two" else 1
    channel, level = COLOURS[spec["colour"]]
    # two shapes split the half's long side in two cells, one shape takes the whole half
    cells = [(x0, y0, w, h)]
    if n == 2:
        cells = (
            [(x0, y0, w, h // 2), (x0, y0 + h // 2, w, h // 2)]
            if h >= w
            else [(x0, y0, w // 2, h), (x0 + w // 2, y0, w // 2, h)]
        )
    for cx, cy, cw, ch in cells:
        side = rng.choice((5, 6))
        mask = _shape_mask(spec["shape"], side)
        left = cx + rng.randint(1, max(1, cw - side - 1))
        top = cy + rng.randint(1, max(1, ch - side - 1))
        colour = np.array([rng.uniform(0.0, 0.15) for _ in range(3)], dtype=np.float32)
        colour[channel] = level + rng.uniform(-0.1, 0.1)
        img[top : top + side, left : left + side][mask] = colour
    return img


def generate(rng: random.Random, **_: Any) -> tuple[str, dict, dict]:
    """A prompt row: its text, the attributes as ground truth, and the attributes again in
    ``extra_info`` (options are the image set's, `write_images`)."""
    spec = random_spec(rng)
    return prompt_text(spec), dict(spec), {"attributes": dict(spec)}


def png_bytes(img: np.ndarray, optimize: bool = False) -> bytes:
    """An (H, W, 3) image in [0, 1] as PNG bytes (8 bits a channel)."""
    from PIL import Image

    buf = io.BytesIO()
    pixels = (np.clip(img, 0, 1) * 255).round().astype(np.uint8)
    Image.fromarray(pixels).save(buf, "PNG", optimize=optimize)
    return buf.getvalue()


def write_images(out_dir: str | Path, seed: int = 0, num_images: int = 4096, size: int = 16,
                 **_: Any) -> Path:  # fmt: skip
    """Write ``images.parquet``: ``num_images`` rendered prompts (columns ``image`` PNG bytes,
    ``prompt``, and one per attribute)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(f"shapes-images-{seed}")
    rows = []
    for _ in range(num_images):
        spec = random_spec(rng)
        rows.append(
            {"image": png_bytes(render(spec, rng, size)), "prompt": prompt_text(spec), **spec}
        )
    path = Path(out_dir) / "images.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def read_images(path: str | Path) -> tuple[np.ndarray, list[dict[str, str]]]:
    """``images.parquet`` (of `write_images`) -> ``(images (N, H, W, 3) float32 in [0, 1], specs)``.

    Raises:
        DataError: not a parquet file, no rows, a column of `write_images` missing, an
            attribute value the task does not have, or an ``image`` that is not an image of
            the others' size (one line naming the file, row and column).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from lmrl.errors import DataError

    hint = "give the images.parquet that `lmrl tasks shapes --out DIR` writes in DIR"
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as err:
        why = (str(err).splitlines() or [type(err).__name__])[0]
        raise DataError(f"{path}: not a readable parquet file ({why}); {hint}") from None
    missing = [c for c in ("image", *ATTRIBUTES) if c not in table.column_names]
    if missing:
        raise DataError(
            f"{path}: no column {', '.join(map(repr, missing))} (its columns: "
            f"{', '.join(table.column_names[:8])}): not an images file; {hint}"
        )
    if table.num_rows == 0:
        raise DataError(f"{path}: no rows; {hint}")
    images, specs = [], []
    for i, row in enumerate(table.select(["image", *ATTRIBUTES]).to_pylist()):
        for key, values in ATTRIBUTES.items():
            if row[key] not in values:
                raise DataError(
                    f"{path}: row {i}: column {key!r} is {row[key]!r}, not one of {list(values)}"
                )
        try:
            image = np.asarray(Image.open(io.BytesIO(row["image"])).convert("RGB"))
        except (OSError, TypeError, ValueError) as err:  # not image bytes
            raise DataError(f"{path}: row {i}: column 'image' is not an image ({err})") from None
        if images and image.shape != images[0].shape:
            raise DataError(
                f"{path}: row {i}: a {image.shape[1]}x{image.shape[0]} image among "
                f"{images[0].shape[1]}x{images[0].shape[0]} ones"
            )
        images.append(image)
        specs.append({key: row[key] for key in ATTRIBUTES})
    return np.stack(images).astype(np.float32) / 255, specs
