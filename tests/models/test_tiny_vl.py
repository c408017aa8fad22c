"""Tiny vision-language models: built locally, loaded by the user's path, a forward with an
image, the vision tower frozen, LoRA in the language model only."""

import pytest
import torch
from PIL import Image

from lmrl.errors import ModelError
from lmrl.models.loading import (
    freeze,
    load_causal_lm,
    load_image_text_lm,
    load_processor,
    vision_tower,
)
from lmrl.models.lora import apply_lora, check_lora_targets
from lmrl.models.tiny_vl import VISION_TOKENS, build_tiny_vl_model, build_vl_tokenizer

ARCHS = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLProcessor"),
}


@pytest.fixture(scope="module")
def vl_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-vl")
    return {arch: build_tiny_vl_model(root / arch, arch=arch, seed=0) for arch in ARCHS}


def _image(width, height, seed):
    pixels = torch.randint(
        0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed)
    )
    return Image.fromarray(pixels.to(torch.uint8).numpy())


def _batch(processor, images):
    """One prompt with the images, one text-only prompt: left-padded."""
    blocks = [{"type": "image"} for _ in images] + [{"type": "text", "text": "what is it?"}]
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": blocks}], add_generation_prompt=True, tokenize=False
        ),
        processor.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
        ),
    ]
    return processor(text=texts, images=images, return_tensors="pt", padding=True)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_build_and_reload_through_the_user_loader(arch, vl_dirs):
    model_cls, processor_cls = ARCHS[arch]
    model = load_image_text_lm(vl_dirs[arch])
    processor = load_processor(vl_dirs[arch])
    assert type(model).__name__ == model_cls
    assert type(processor).__name__ == processor_cls
    # the vision tokens are single tokens, and their ids are the config's
    ids = processor.tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    cfg = model.config
    assert ids == [cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id,
                   cfg.video_token_id]  # fmt: skip
    assert processor.image_token_id == cfg.image_token_id
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>3+4?<|im_end|>\n"
    assert processor.tokenizer(text)["input_ids"] == build_vl_tokenizer()(text)["input_ids"]
    assert processor.tokenizer.pad_token is not None


def test_a_text_model_is_not_loaded_as_vision_language(tiny_workspace, vl_dirs):
    with pytest.raises(ModelError, match="not an image-text-to-text model"):
        load_image_text_lm(tiny_workspace / "model")
    with pytest.raises(ModelError, match="not a causal language model"):
        load_causal_lm(vl_dirs["qwen2_vl"])  # the text path is unchanged: it refuses VL


@pytest.mark.parametrize("arch", list(ARCHS))
def test_forward_with_an_image_uses_it(arch, vl_dirs):
    model = freeze(load_image_text_lm(vl_dirs[arch]))
    processor = load_processor(vl_dirs[arch])
    one = _batch(processor, [_image(56, 28, seed=0)])
    other = _batch(processor, [_image(56, 28, seed=1)])
    assert one["image_grid_thw"].tolist() == [[1, 2, 4]]  # 28x56 px: 2x4 patches, 2 tokens
    assert int((one["input_ids"] == processor.image_token_id).sum()) == 2
    assert not one["attention_mask"][1, 0]  # the text-only row is left-padded
    with torch.no_grad():
        logits = model(**one).logits
        logits_other = model(**other).logits
    assert logits.shape == (*one["input_ids"].shape, model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()
    assert not torch.allclose(logits[0, -1], logits_other[0, -1])  # the pixels reach the LM
    torch.testing.assert_close(logits[1], logits_other[1])  # and only their own row


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_vision_tower_is_frozen_by_default(arch, vl_dirs):
    model = load_image_text_lm(vl_dirs[arch])
    name, tower = vision_tower(model)
    assert name == "model.visual"
    assert all(not p.requires_grad for p in tower.parameters())
    language = [p for n, p in model.named_parameters() if not n.startswith("model.visual.")]
    assert language and all(p.requires_grad for p in language)
    trainable = load_image_text_lm(vl_dirs[arch], freeze_vision=False)
    assert all(p.requires_grad for p in trainable.parameters())


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])  # Qwen2-VL: as Qwen2.5-VL
def test_lora_adapts_the_language_model_only(arch, vl_dirs):
    torch.manual_seed(0)
    model = apply_lora(load_image_text_lm(vl_dirs[arch]), lora_rank=4)
    adapted = [n for n, _ in model.named_parameters() if ".lora_A." in n]
    assert adapted and all(".language_model." in n for n in adapted), adapted[:5]
    assert not any(".visual." in n for n in adapted)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(".lora_" in n for n in trainable)

    # the reference is the adapter-off model, as for text
    processor = load_processor(vl_dirs[arch])
    batch = _batch(processor, [_image(28, 56, seed=2)])
    with torch.no_grad():
        base = model.get_base_model()(**batch).logits
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0.0, 0.5)
        adapted_logits = model(**batch).logits
        with model.disable_adapter():
            reference = model(**batch).logits
    assert not torch.allclose(adapted_logits, base)
    torch.testing.assert_close(reference, base)


def test_a_lora_target_only_the_vision_tower_has_is_refused(vl_dirs):
    model = load_image_text_lm(vl_dirs["qwen2_vl"])
    assert any(n.endswith(".qkv") for n, _ in model.named_modules())  # the tower's attention
    with pytest.raises(ModelError, match="'qkv' matches no module of the language model"):
        check_lora_targets(model, ["qkv"], "the model")
    with pytest.raises(ModelError, match="'qkv' matches no module of the language model"):
        apply_lora(model, lora_rank=4, target_modules=["q_proj", "qkv"])
    check_lora_targets(model, ["q_proj", "down_proj"], "the model")


def test_cli_builds_a_vision_language_model(tmp_path, capsys):
    from lmrl.cli import main

    assert main(["tiny-model", str(tmp_path / "vl"), "--arch", "qwen2_5_vl", "--seed", "3"]) == 0
    assert "qwen2_5_vl model and its processor written" in capsys.readouterr().out
    assert type(load_image_text_lm(tmp_path / "vl")).__name__ == ARCHS["qwen2_5_vl"][0]
    assert type(load_processor(tmp_path / "vl")).__name__ == ARCHS["qwen2_5_vl"][1]
    assert main(["tiny-model", str(tmp_path / "x"), "--arch", "qwen2_vl", "--size", "small"]) == 2
    assert "built in one size" in capsys.readouterr().err
