"""Images in prompts: reading them, checking them, and a prompt's model inputs.

Data comes in verl's layout: chat messages whose text holds one ``<image>`` placeholder per
image, and an ``images`` column (``data.image_key``) holding the row's images, each as bytes,
a ``{"bytes": ..., "path": ...}`` dict (as ``datasets`` stores an image in parquet), a file path
(relative to the data file's directory unless absolute) or a PIL image. TRL's layout is read
too: an ``image`` column (one image) or ``images``, and messages whose content is a list of
``{"type": "image"}`` / ``{"type": "text", "text": ...}`` blocks.

Choices:

- Everything a user can get wrong is checked when the data loads, each fault a
  ``lmrl.errors.DataError`` of one line naming the file, the row and the column: the number of
  placeholders differs from the number of images; an image does not open (a missing file, a
  truncated or non-image file); an image that the processor's own resize rule (``smart_resize``
  of transformers' Qwen2-VL image processor) would take outside ``[min_pixels, max_pixels]`` or
  refuses (an aspect ratio over 200); a prompt that already holds the processor's vision tokens
  (``<|image_pad|>``...: an expanded prompt would be expanded twice).
- The processor expands each image's placeholder once, into ``grid_t * grid_h * grid_w /
  merge_size**2`` pad tokens; the count is checked against ``image_grid_thw`` for every prompt.
- Truncating a prompt never cuts into an image's tokens (nor drops an image): it is refused.
- The 3-D M-RoPE position ids come from the model's own ``get_rope_index`` over the
  left-padded batch, so they are the positions the model computes for itself.
"""

from __future__ import annotations

import importlib
import inspect
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lmrl.errors import DataError

IMAGE_PLACEHOLDER = "<image>"
IMAGE_KEY = "images"  # verl's data.image_key
TRL_IMAGE_KEY = "image"  # TRL's one-image column
MAX_ASPECT_RATIO = 200  # the processor's smart_resize refuses more
VISION_MARKERS = ("<|vision_start|>", "<|vision_end|>")  # around each image's pad tokens


# ---------------------------------------------------------------------------- reading
def open_image(value: Any, base_dir: Path | None, where: str):
    """One image of a row as an RGB ``PIL.Image``, fully decoded.

    Args:
        value: bytes, a ``{"bytes": ..., "path": ...}`` dict, a path (``str``/``Path``, a
            ``file://`` URL; relative to ``base_dir``) or a PIL image.
        base_dir: the data file's directory, for relative paths (None: the working directory).
        where: ``"<file>: row <i>: column '<name>': image <k>"``, for messages.
    Raises:
        DataError: a value of another type, a missing file, or bytes that are not an image.
    """
    from PIL import Image

    if isinstance(value, Mapping):
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path") is not None:
            value = value["path"]
        else:
            raise DataError(
                f"{where}: an image dict needs 'bytes' or 'path', got {dict(value)!r:.80}"
            )
    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, bytes | bytearray):
        image = _open(io.BytesIO(value), where)
    elif isinstance(value, str | Path):
        path = Path(str(value).removeprefix("file://")).expanduser()
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            raise DataError(f"{where}: image file {path} does not exist")
        image = _open(path, where)
    else:
        raise DataError(
            f"{where}: an image must be bytes, a path, a {{'bytes', 'path'}} dict or a PIL "
            f"image, got {type(value).__name__}"
        )
    return image if image.mode == "RGB" else image.convert("RGB")


def _open(source, where: str):
    from PIL import Image

    try:
        image = Image.open(source)
        image.load()  # decode it all: a truncated file fails here, not in the processor
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise DataError(f"{where}: cannot open the image ({err})") from None
    return image


def image_column(row: Mapping[str, Any], image_key: str = IMAGE_KEY) -> str | None:
    """The column holding ``row``'s images: ``image_key``, else TRL's ``image`` when
    ``image_key`` is the default ``images``; None when the row has neither (a text-only row)."""
    if image_key in row:
        return image_key
    if image_key == IMAGE_KEY and TRL_IMAGE_KEY in row:
        return TRL_IMAGE_KEY
    return None


def read_images(
    row: Mapping[str, Any], where: str, base_dir: Path | None = None, image_key: str = IMAGE_KEY
) -> list:
    """``row``'s images (`image_column`), opened (`open_image`); ``[]`` for a text-only row
    (no column, None, or an empty list).

    Args:
        where: ``"<file>: row <i>"``, for messages.
    """
    column = image_column(row, image_key)
    if column is None or row[column] is None:
        return []
    value = row[column]
    many = isinstance(value, Sequence) and not isinstance(value, str | bytes)
    values = list(value) if many else [value]
    return [
        open_image(v, base_dir, f"{where}: column {column!r}: image {k}")
        for k, v in enumerate(values)
    ]


# ---------------------------------------------------------------------------- messages
def _split(text: str) -> list[dict[str, str]]:
    """Text with ``<image>`` placeholders as content blocks, in order."""
    blocks: list[dict[str, str]] = []
    for i, part in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i:
            blocks.append({"type": "image"})
        if part:
            blocks.append({"type": "text", "text": part})
    return blocks


def image_messages(prompt: Any, num_images: int, where: str) -> list[dict[str, Any]]:
    """A prompt as chat messages whose content is a list of ``{"type": "image"}`` and
    ``{"type": "text", "text": ...}`` blocks (the processor's chat-template format), checking
    that it has one placeholder per image.

    Args:
        prompt: a list of messages whose content is a string with ``<image>`` placeholders
            (verl) or a list of content blocks (TRL); a plain string is one user message.
        num_images: how many images the row holds.
        where: ``"<file>: row <i>: column '<prompt>'"``, for messages.
    Raises:
        DataError: a placeholder count other than ``num_images``, or a malformed block.
    """
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    messages, placeholders = [], 0
    for j, message in enumerate(prompt):
        if not isinstance(message, Mapping) or "content" not in message:
            raise DataError(f"{where}: message {j} must be a dict with 'role' and 'content'")
        content = message["content"]
        if isinstance(content, str):
            blocks = _split(content)
        elif isinstance(content, Sequence):
            blocks = []
            for b, block in enumerate(content):
                kind = block.get("type") if isinstance(block, Mapping) else None
                if kind == "image":
                    blocks.append({"type": "image"})
                elif kind == "text" and isinstance(block.get("text"), str):
                    blocks.extend(_split(block["text"]))
                else:
                    raise DataError(
                        f"{where}: message {j} block {b} must be {{'type': 'image'}} or "
                        f"{{'type': 'text', 'text': str}}, got {block!r:.80}"
                    )
        else:
            raise DataError(
                f"{where}: message {j} content must be a string or a list of blocks, got "
                f"{type(content).__name__}"
            )
        placeholders += sum(block["type"] == "image" for block in blocks)
        messages.append({**message, "content": blocks})
    if placeholders != num_images:
        raise DataError(
            f"{where}: {placeholders} image placeholder(s) (<image> or {{'type': 'image'}}) but "
            f"{num_images} image(s) in the row; give one placeholder per image"
        )
    return messages


# ---------------------------------------------------------------------------- sizes
def pixel_bounds(image_processor) -> tuple[int, int, int]:
    """``(min_pixels, max_pixels, factor)`` of a Qwen-VL image processor: the bounds its
    resize keeps an image within, and the side multiple (``patch_size * merge_size``)."""
    size = image_processor.size
    low, high = size["shortest_edge"], size["longest_edge"]
    return int(low), int(high), int(image_processor.patch_size * image_processor.merge_size)


def resized_size(image_processor, height: int, width: int) -> tuple[int, int]:
    """``(height, width)`` the processor resizes an image to, by its own ``smart_resize``.

    Raises:
        ValueError: the processor refuses the image (an aspect ratio over 200).
    """
    module = importlib.import_module(type(image_processor).__module__)
    low, high, factor = pixel_bounds(image_processor)
    return module.smart_resize(height, width, factor=factor, min_pixels=low, max_pixels=high)


def image_tokens(image_processor, image, where: str) -> int:
    """How many pad tokens the processor expands ``image``'s placeholder into, after checking
    that its resize keeps it within ``[min_pixels, max_pixels]``.

    Args:
        image: a PIL image (`open_image`).
        where: ``"<file>: row <i>: column '<name>': image <k>"``, for messages.
    Raises:
        DataError: an image the processor refuses or resizes outside its bounds (a very
            elongated one), with its size and the bounds.
    """
    width, height = image.size
    low, high, _ = pixel_bounds(image_processor)
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise DataError(
            f"{where}: the image is {width}x{height} px, an aspect ratio over "
            f"{MAX_ASPECT_RATIO} that the processor refuses; crop or pad it"
        )
    h, w = resized_size(image_processor, height, width)
    if not low <= h * w <= high:
        raise DataError(
            f"{where}: the image is {width}x{height} px, which the processor resizes to {w}x{h} "
            f"= {w * h} px, outside min_pixels={low}..max_pixels={high}; crop or pad it to a "
            "squarer shape"
        )
    return (
        (h // image_processor.patch_size)
        * (w // image_processor.patch_size)
        // (image_processor.merge_size**2)
    )


def check_row_images(
    row: Mapping[str, Any],
    file: str | Path,
    row_index: int,
    processor,
    prompt_key: str = "prompt",
    image_key: str = IMAGE_KEY,
) -> tuple[list[dict[str, Any]], list, list[int]]:
    """Every load-time check of one row: its images open, their placeholders match, their
    sizes fit the processor's bounds, its text holds none of the processor's vision tokens.

    Args:
        row: the row as read (its prompt already checked for shape, e.g. by
            ``lmrl.data.dataset.check_prompt``).
        file, row_index: where it was read, for messages; relative image paths are read from
            ``file``'s directory.
        processor: the model's processor (`lmrl.models.loading.load_processor`).
        prompt_key, image_key: the prompt and image columns (``data.prompt_key``,
            ``data.image_key``).

    Returns:
        ``(messages, images, tokens)``: the messages in content-block form
        (`image_messages`), the RGB images, and each image's pad-token count.
    Raises:
        DataError: ``"<file>: row <i>: column '<name>': ..."``.
    """
    at = f"{file}: row {row_index}"
    images = read_images(row, at, Path(file).parent, image_key)
    messages = image_messages(row[prompt_key], len(images), f"{at}: column {prompt_key!r}")
    refuse_vision_tokens(processor, messages, f"{at}: column {prompt_key!r}")
    column = image_column(row, image_key)
    tokens = [
        image_tokens(processor.image_processor, image, f"{at}: column {column!r}: image {k}")
        for k, image in enumerate(images)
    ]
    return messages, images, tokens


# ---------------------------------------------------------------------------- model inputs
def vision_tokens(processor) -> tuple[str, ...]:
    """The processor's vision tokens: its image and video pad tokens and the markers around
    them (``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_start|>``, ``<|vision_end|>``)."""
    return (processor.image_token, processor.video_token, *VISION_MARKERS)


def vision_token_ids(processor) -> dict[str, int]:
    """The processor's vision tokens (`vision_tokens`) that its tokenizer has, and their ids
    (reads the whole vocabulary: call it once per dataset)."""
    vocab = processor.tokenizer.get_vocab()
    return {name: vocab[name] for name in vision_tokens(processor) if name in vocab}


def refuse_vision_tokens(processor, messages: list[dict[str, Any]], where: str) -> None:
    """Refuse a prompt whose text already holds the processor's vision tokens
    (``<|image_pad|>``...): an expanded prompt would be expanded twice.

    Args:
        messages: content-block messages (`image_messages`).
    Raises:
        DataError: naming the token.
    """
    for name in vision_tokens(processor):
        for message in messages:
            for block in message["content"]:
                if block["type"] == "text" and name in block["text"]:
                    raise DataError(
                        f"{where}: the prompt text holds the processor's own token {name!r}: it "
                        "is already expanded and would be expanded again; write one <image> "
                        "per image instead"
                    )


def check_image_tokens(
    input_ids: Sequence[int] | torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    image_token_id: int,
    merge_size: int,
    where: str,
) -> None:
    """The expanded-twice guard: a prompt holds exactly ``sum(grid_thw.prod()) //
    merge_size**2`` image pad tokens, the count its images' features fill.

    Args:
        input_ids: one prompt's ids (P,).
        image_grid_thw: (n_images, 3) long, or None for a text-only prompt.
    Raises:
        DataError: another count (the placeholders were expanded twice, or not at all).
    """
    ids = torch.as_tensor(input_ids)
    found = int((ids == image_token_id).sum())
    expected = 0 if image_grid_thw is None else int(image_grid_thw.prod(-1).sum()) // merge_size**2
    if found != expected:
        raise DataError(
            f"{where}: the prompt holds {found} image pad tokens but its images fill {expected}; "
            "an image's placeholder was expanded twice (or not at all): write one <image> per "
            "image and let the processor expand it"
        )


def prompt_inputs(
    processor,
    messages: list[dict[str, Any]],
    images: Sequence,
    where: str,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One prompt's model inputs from the processor, each image's placeholder expanded once.

    Args:
        processor: the model's processor (`lmrl.models.loading.load_processor`).
        messages: content-block messages (`image_messages`).
        images: their images, in placeholder order.
        where: ``"<file>: row <i>: column '<prompt>'"``, for messages.
        chat_template_kwargs: extra keyword arguments of ``apply_chat_template``.

    Returns:
        ``input_ids`` (list of P ints), ``pixel_values`` (N_patches, C*t*p*p) float or None,
        ``image_grid_thw`` (n_images, 3) long or None.
    Raises:
        DataError: a prompt text that already holds the processor's vision tokens, a
            processor that refuses the prompt, or an image-token count that differs from
            the images' (`check_image_tokens`).
    """
    refuse_vision_tokens(processor, messages, where)
    text = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **dict(chat_template_kwargs or {})
    )
    try:
        out = processor(text=[text], images=list(images) or None, return_tensors="pt")
    except ValueError as err:
        raise DataError(f"{where}: the processor refuses the prompt ({err})") from None
    grid = out.get("image_grid_thw") if images else None
    ids = out["input_ids"][0]
    merge = processor.image_processor.merge_size
    check_image_tokens(ids, grid, processor.image_token_id, merge, where)
    return {
        "input_ids": ids.tolist(),
        "pixel_values": out["pixel_values"] if images else None,
        "image_grid_thw": grid,
    }


def truncate_ids(
    ids: Sequence[int], max_length: int, side: str, vision_ids: Sequence[int], where: str
) -> list[int]:
    """``ids`` cut to ``max_length`` tokens on the ``left`` or ``right``, refusing a cut that
    would drop any of an image's tokens (``vision_ids``: `vision_token_ids`'s values).

    Raises:
        DataError: the cut reaches an image, naming the lengths and the keys to change.
    """
    if len(ids) <= max_length:
        return list(ids)
    kept, dropped = (ids[-max_length:], ids[:-max_length]) if side == "left" else (ids[:max_length], ids[max_length:])  # fmt: skip
    protected = set(vision_ids)
    if any(t in protected for t in dropped):
        raise DataError(
            f"{where}: truncation={side} to max_prompt_length={max_length} would cut into an "
            f"image's tokens (the prompt has {len(ids)} tokens); raise data.max_prompt_length "
            "or set data.filter_overlong_prompts=true"
        )
    return list(kept)


# ---------------------------------------------------------------------------- batches
def collate_image_inputs(rows: Sequence[Mapping[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Left-pad prompts and gather their images for one forward.

    Args:
        rows: `prompt_inputs` results (text-only rows have no pixel values).
        pad_token_id: the id padding the left.

    Returns:
        ``input_ids`` (B, P) long, ``attention_mask`` (B, P) bool, ``pixel_values``
        (sum of N_patches, D) or None, ``image_grid_thw`` (n_images, 3) long or None (both in
        row order, as the model splits them), ``num_images`` (B,) long.
    """
    if not rows:
        raise ValueError("collate_image_inputs needs at least one row")
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[i, width - n :] = torch.as_tensor(r["input_ids"], dtype=torch.long)
        attention_mask[i, width - n :] = True
    pixels = [r["pixel_values"] for r in rows if r["pixel_values"] is not None]
    grids = [r["image_grid_thw"] for r in rows if r["image_grid_thw"] is not None]
    counts = [0 if r["image_grid_thw"] is None else len(r["image_grid_thw"]) for r in rows]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "pixel_values": torch.cat(pixels) if pixels else None,
        "image_grid_thw": torch.cat(grids).long() if grids else None,
        "num_images": torch.tensor(counts, dtype=torch.long),
    }


def mrope_position_ids(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
) -> torch.Tensor:
    """The 3-D M-RoPE position ids of a left-padded batch, by the model's own
    ``get_rope_index`` (on ``model.model`` for the Qwen VL families; a PEFT wrapper is looked
    through): the positions the model computes when none are passed.

    Text tokens count 0, 1, 2... from each row's first real token on all three axes; an
    image's tokens take (temporal, row, column) offsets from its start, and the text after
    it resumes past its largest offset. Padding gets 0.

    Args:
        input_ids: (B, P) long.
        attention_mask: (B, P), True/1 on real tokens.
        image_grid_thw: (n_images, 3) long, the batch's images in row order, or None.

    Returns:
        (3, B, P) long.
    """
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    inner = getattr(base, "model", None)
    rope_index = getattr(inner, "get_rope_index", None) or getattr(base, "get_rope_index", None)
    if not callable(rope_index):
        raise ValueError(f"{type(base).__name__} has no get_rope_index: not an M-RoPE model")
    kwargs: dict[str, Any] = {"image_grid_thw": image_grid_thw, "attention_mask": attention_mask}
    if "mm_token_type_ids" in inspect.signature(rope_index).parameters:
        # text 0, image 1 (the processor's token types; prompts hold no videos)
        kwargs["mm_token_type_ids"] = (input_ids == base.config.image_token_id).long()
    position_ids, _ = rope_index(input_ids, **kwargs)
    return position_ids
