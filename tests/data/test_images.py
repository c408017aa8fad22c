"""Images in prompts: reading every stored form, the load-time checks (each a one-line
DataError naming file, row and column), the processor's inputs with each image expanded once,
truncation, and the 3-D positions of a left-padded batch mixing image and text-only rows."""

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from lmrl.data.images import (
    check_image_tokens,
    check_row_images,
    collate_image_inputs,
    image_messages,
    image_tokens,
    mrope_position_ids,
    open_image,
    prompt_inputs,
    read_images,
    truncate_ids,
    vision_token_ids,
)
from lmrl.errors import DataError
from lmrl.models.loading import freeze, load_image_text_lm, load_processor
from lmrl.models.tiny_vl import VL_ARCHS, build_tiny_vl_model


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-vl-data")
    return {a: build_tiny_vl_model(root / a, arch=a, seed=0) for a in VL_ARCHS}


@pytest.fixture(scope="module")
def processor(vl_dirs):
    return load_processor(vl_dirs["qwen2_vl"])


def _image(width, height, seed=0):
    pixels = torch.randint(
        0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed)
    )
    return Image.fromarray(pixels.to(torch.uint8).numpy())


def _png(image):
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _user(text):
    return [{"role": "user", "content": text}]


def _inputs(processor, text, images, where="data.parquet: row 0: column 'prompt'"):
    return prompt_inputs(processor, image_messages(_user(text), len(images), where), images, where)


# ---------------------------------------------------------------------------- reading
def test_every_stored_form_of_an_image_opens(tmp_path):
    image = _image(40, 30)
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png(image))
    forms = [
        _png(image),
        {"bytes": _png(image), "path": None},
        {"bytes": None, "path": "img/a.png"},  # relative to the data file's directory
        "img/a.png",
        str(tmp_path / "img" / "a.png"),
        image.convert("L"),  # a grey PIL image: converted to RGB
    ]
    # {"bytes", "path"} structs read back from parquet, as datasets stores images there
    pq.write_table(pa.table({"images": [forms[1:3]]}), tmp_path / "d.parquet")
    stored = pq.read_table(tmp_path / "d.parquet").to_pylist()[0]["images"]
    assert stored == forms[1:3]
    opened = read_images({"images": [forms[0], *stored, *forms[3:]]}, "d: row 0", tmp_path)
    assert len(opened) == 6
    for got in opened:
        assert got.mode == "RGB" and got.size == (40, 30)
    assert opened[0].tobytes() == image.tobytes()
    # TRL's one-image column; a row without images is text-only
    assert len(read_images({"image": _png(image)}, "d: row 1", tmp_path)) == 1
    assert read_images({"prompt": "x"}, "d: row 2") == []
    assert read_images({"images": None}, "d: row 3") == []


@pytest.mark.parametrize(
    "value, message",
    [
        (_png(_image(28, 28))[:60], "cannot open the image"),  # a truncated PNG
        (b"not an image at all", "cannot open the image"),
        ("missing.png", "image file .*missing.png does not exist"),
        ({"bytes": None, "path": None}, "an image dict needs 'bytes' or 'path'"),
        (7, "an image must be bytes, a path"),
    ],
)
def test_an_image_that_does_not_open_is_one_line_naming_the_row(tmp_path, value, message):
    row = {"images": [_png(_image(28, 28)), value]}
    with pytest.raises(DataError, match=f"^d.parquet: row 4: column 'images': image 1: {message}"):
        read_images(row, "d.parquet: row 4", tmp_path)


def test_open_image_reads_a_pil_image_as_it_is():
    image = _image(28, 28)
    assert open_image(image, None, "x") is image


# ---------------------------------------------------------------------------- messages
def test_verl_placeholders_and_trl_blocks_give_the_same_messages():
    verl = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "<image>left or <image>right?"}]  # fmt: skip
    trl = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
           {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "left or "},
                                        {"type": "image"}, {"type": "text", "text": "right?"}]}]  # fmt: skip
    assert image_messages(verl, 2, "x") == image_messages(trl, 2, "x")
    assert image_messages("<image>what?", 1, "x") == [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}
    ]


@pytest.mark.parametrize(
    "text, images", [("<image><image> which?", 1), ("which?", 1), ("<image>", 0)]
)
def test_a_wrong_placeholder_count_is_refused_at_load(tmp_path, processor, text, images):
    row = {"prompt": _user(text), "images": [_png(_image(28, 28))] * images}
    with pytest.raises(
        DataError, match=r"^.*d\.parquet: row 2: column 'prompt': \d image placeholder"
    ):
        check_row_images(row, tmp_path / "d.parquet", 2, processor)


def test_a_malformed_content_block_is_refused():
    with pytest.raises(DataError, match="message 0 block 1 must be"):
        image_messages(
            [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}]}], 1, "x"
        )


# ---------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("size", [(28, 28), (56, 28), (28, 56), (56, 56), (50, 40), (20, 20)])
def test_image_tokens_equal_the_processors_count(processor, size):
    image = _image(*size)
    tokens = image_tokens(processor.image_processor, image, "x")
    grid = processor.image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
    assert tokens == int(grid.prod()) // processor.image_processor.merge_size**2


@pytest.mark.parametrize(
    "size, message",
    [
        (
            (28, 2000),
            "28x2000 px, which the processor resizes to 28x924 = 25872 px, outside "
            "min_pixels=784..max_pixels=12544",
        ),
        ((6000, 28), "an aspect ratio over 200"),
    ],
)
def test_pixel_bounds_are_checked_with_the_processors_resize(tmp_path, processor, size, message):
    row = {"prompt": _user("<image>x"), "images": [_png(_image(*size))]}
    with pytest.raises(
        DataError, match=f"^.*d.parquet: row 0: column 'images': image 0: .*{message}"
    ):
        check_row_images(row, tmp_path / "d.parquet", 0, processor)


def test_a_good_row_passes_every_check(tmp_path, processor):
    row = {
        "prompt": _user("<image> and <image>?"),
        "images": [_png(_image(28, 56)), _png(_image(56, 56))],
    }
    messages, images, tokens = check_row_images(row, tmp_path / "d.parquet", 0, processor)
    assert tokens == [2, 4] and [im.size for im in images] == [(28, 56), (56, 56)]
    assert [b["type"] for b in messages[0]["content"]] == ["image", "text", "image", "text"]


# ---------------------------------------------------------------------------- model inputs
def test_two_images_of_different_sizes_expand_once_each(processor):
    out = _inputs(processor, "<image>left, <image>right?", [_image(56, 28), _image(56, 56, 1)])
    assert out["image_grid_thw"].tolist() == [[1, 2, 4], [1, 4, 4]]
    assert out["pixel_values"].shape[0] == 8 + 16
    ids = torch.tensor(out["input_ids"])
    pad = processor.image_token_id
    assert int((ids == pad).sum()) == 2 + 4
    start = processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
    first = ids.tolist().index(start)
    assert ids[first + 1 : first + 3].tolist() == [pad, pad]  # the first image: its 2 tokens
    assert ids[first + 3] != pad


def test_a_text_only_prompt_has_no_pixels(processor):
    out = _inputs(processor, "just text", [])
    assert out["pixel_values"] is None and out["image_grid_thw"] is None
    assert processor.image_token_id not in out["input_ids"]


def test_an_already_expanded_prompt_is_refused(processor):
    where = "d.parquet: row 5: column 'prompt'"
    # a prompt holding the processor's own tokens: the 28x28 image fills exactly one pad
    # token, so the processor alone would take it silently
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "<|vision_start|><|image_pad|><|vision_end|>what?"}]}]  # fmt: skip
    with pytest.raises(
        DataError, match=r"^d.parquet: row 5: .*'<\|image_pad\|>': it is already expanded"
    ):
        prompt_inputs(processor, messages, [_image(28, 28)], where)
    # and at load, with verl's placeholder beside the expanded tokens
    row = {"prompt": _user("<image><|vision_start|>what?"), "images": [_png(_image(28, 28))]}
    with pytest.raises(DataError, match=r"^d.parquet: row 5: column 'prompt': .*'<\|vision_start"):
        check_row_images(row, "d.parquet", 5, processor)


def test_the_image_token_count_must_equal_the_processors(processor):
    out = _inputs(processor, "<image>what?", [_image(56, 28)])
    ids, grid, pad = out["input_ids"], out["image_grid_thw"], processor.image_token_id
    check_image_tokens(ids, grid, pad, 2, "x")  # as the processor made it
    twice = [*ids[:3], pad, pad, *ids[3:]]  # the 2 tokens expanded once more
    with pytest.raises(
        DataError, match=r"^row 1: the prompt holds 4 image pad tokens but its images fill 2"
    ):
        check_image_tokens(twice, grid, pad, 2, "row 1")
    with pytest.raises(DataError, match="holds 2 image pad tokens but its images fill 0"):
        check_image_tokens(ids, None, pad, 2, "row 1")


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncation_into_an_image_is_refused(processor, side):
    out = _inputs(processor, "before the image <image> after the image", [_image(56, 56)])
    ids, protected = out["input_ids"], list(vision_token_ids(processor).values())
    first = min(i for i, t in enumerate(ids) if t in protected)
    last = max(i for i, t in enumerate(ids) if t in protected)
    text_only = len(ids) - first if side == "left" else last + 1  # cuts text only
    kept = truncate_ids(ids, text_only, side, protected, "x")
    assert len(kept) == text_only and sum(t in protected for t in kept) == 1 + 4 + 1
    with pytest.raises(
        DataError, match=f"^r: truncation={side} to max_prompt_length={text_only - 1} would cut"
    ):
        truncate_ids(ids, text_only - 1, side, protected, "r")
    assert truncate_ids(ids, len(ids), side, protected, "x") == ids


# ---------------------------------------------------------------------------- batches
@pytest.mark.parametrize("arch", VL_ARCHS)
def test_positions_of_a_mixed_left_padded_batch_are_the_models_own(vl_dirs, arch):
    model = freeze(load_image_text_lm(vl_dirs[arch]))
    processor = load_processor(vl_dirs[arch])
    rows = [
        _inputs(processor, "<image>left or <image>right?", [_image(56, 28), _image(56, 56, 1)]),
        _inputs(processor, "no image here", []),
        _inputs(processor, "and <image>?", [_image(28, 28, 2)]),
    ]
    batch = collate_image_inputs(rows, processor.tokenizer.pad_token_id)
    assert batch["num_images"].tolist() == [2, 0, 1]
    assert batch["image_grid_thw"].shape == (3, 3) and batch["pixel_values"].shape[0] == 8 + 16 + 4
    mask = batch["attention_mask"]
    assert not mask[1, 0] and not mask[2, 0] and mask[:, -1].all()  # left padding

    position_ids = mrope_position_ids(model, batch["input_ids"], mask, batch["image_grid_thw"])
    assert position_ids.shape == (3, *batch["input_ids"].shape)
    text_positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    # the text-only row counts as text does; the image rows do not
    assert (position_ids[:, 1] == text_positions[1]).all()
    assert not (position_ids[:, 0] == text_positions[0]).all()

    inputs = {
        k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")
    }
    token_types = (batch["input_ids"] == model.config.image_token_id).long()
    with torch.no_grad():
        own = model(**inputs, mm_token_type_ids=token_types).logits  # the model's positions
        given = model(**inputs, position_ids=position_ids).logits
        naive = model(**inputs, position_ids=text_positions).logits
        alone = model(input_ids=torch.tensor([rows[1]["input_ids"]])).logits
    real = mask.unsqueeze(-1).expand_as(own)
    assert torch.equal(own[real], given[real])
    assert not torch.allclose(own[0, -1], naive[0, -1])  # 1-D positions are another model
    n = len(rows[1]["input_ids"])
    torch.testing.assert_close(given[1, -n:], alone[0])  # padding changes nothing
