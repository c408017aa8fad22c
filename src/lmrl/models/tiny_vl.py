"""Tiny vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and their processors, built here.

The vision counterpart of :mod:`lmrl.models.tiny`: the same byte tokenizer plus the family's
vision tokens (``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ``<|video_pad|>``,
their ids written into the config), the family's image processor with small pixel bounds
(every image becomes 1 to 16 image tokens), Qwen2-VL's chat template (a message's content a
string or a list of ``{"type": "image"}`` / ``{"type": "text", "text": ...}`` blocks), and a
model of a few layers with a two-block vision tower. Everything is written with
``save_pretrained``, so loading goes through the path a user's ``Qwen2.5-VL-3B-Instruct`` takes
(``lmrl.models.loading.load_image_text_lm`` / ``load_processor``).

Choice: the text side has the sizes of the ``tiny`` text model (hidden 64, 2 layers, 4 heads of
16 dims) with M-RoPE sections ``[2, 3, 3]`` (temporal, height, width: half the head dim); the
vision tower keeps the families' patches (14 px, 16 px for Qwen3-VL), 2x2 merge and 2-frame
temporal patches, so the processor's arithmetic is the real one, at 32 dims and two blocks.
Qwen3-VL is built where the installed transformers has it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmrl.errors import ModelError
from lmrl.models.loading import processor_class
from lmrl.models.tiny import (
    IM_END,
    IM_START,
    MAX_LENGTH,
    PAD_TOKEN,
    build_tokenizer,
    init_and_save,
)

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
VL_ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

# the image processor's patch side, and its bounds: one merged 2x2 patch (one image token) to
# 4x4 merged patches (16 tokens)
PATCH_SIZE = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16}
MIN_PIXELS = 28 * 28
MAX_PIXELS = 112 * 112

# Qwen2-VL's layout (ChatML; an image is <|vision_start|><|image_pad|><|vision_end|>, which the
# processor expands to one pad token per merged patch), without its default system prompt.
VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for item in message['content'] %}"
    "{%- if item['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif item['type'] == 'text' %}{{- item['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_vl_tokenizer():
    """lmrl's byte tokenizer (`lmrl.models.tiny.build_tokenizer`) with the vision tokens added
    as special tokens (ids 259-262, after ``<|im_end|>``) and the VL chat template."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, *VISION_TOKENS]})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    return tokenizer


def build_image_processor(arch: str = "qwen2_vl"):
    """The family's image processor (Qwen2-VL's, PIL backend: no torchvision needed; Qwen2.5-VL
    and Qwen3-VL use it too, Qwen3-VL with 16-px patches and a 0.5 mean and std), bounded to
    1 to 16 image tokens."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    scale = (PATCH_SIZE[arch] / 14) ** 2
    kwargs: dict[str, Any] = {
        "min_pixels": round(MIN_PIXELS * scale),
        "max_pixels": round(MAX_PIXELS * scale),
    }
    if arch == "qwen3_vl":
        kwargs.update(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Qwen2VLImageProcessorPil(**kwargs)


def tiny_vl_config(arch: str = "qwen2_vl", vocab_size: int | None = None):
    """The ``transformers`` config of a tiny vision-language model.

    Args:
        arch: ``"qwen2_vl"``, ``"qwen2_5_vl"`` or ``"qwen3_vl"``.
        vocab_size: defaults to the VL tokenizer's size.
    Raises:
        ModelError: an unknown arch (the message lists the valid ones), or Qwen3-VL with a
            transformers that has no Qwen3-VL.
    """
    if arch not in VL_ARCHS:
        raise ModelError(f"arch must be one of {list(VL_ARCHS)}, got {arch!r}")
    tokenizer = build_vl_tokenizer()
    ids = dict(
        zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)), strict=True)
    )
    text = dict(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=176,
        max_position_embeddings=MAX_LENGTH,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        initializer_range=0.02,
    )
    common = dict(
        text_config=text,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True,
    )
    if arch == "qwen3_vl":
        try:
            from transformers import Qwen3VLConfig
        except ImportError:
            import transformers

            raise ModelError(f"transformers {transformers.__version__} has no Qwen3-VL") from None
        text.update(head_dim=16)
        text["rope_parameters"]["mrope_interleaved"] = True
        # 16-px patches; learned position embeddings on a 4x4 grid; deepstack after block 0
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                      num_heads=2, patch_size=16, num_position_embeddings=16,
                      deepstack_visual_indexes=[0])  # fmt: skip
        return Qwen3VLConfig(vision_config=vision, **common)
    if arch == "qwen2_vl":
        from transformers import Qwen2VLConfig

        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
        return Qwen2VLConfig(vision_config=vision, **common)
    from transformers import Qwen2_5_VLConfig

    # window attention over 56-px windows in block 0, full attention in block 1
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2,
                  window_size=56, fullatt_block_indexes=[1])  # fmt: skip
    return Qwen2_5_VLConfig(vision_config=vision, **common)


def build_tiny_vl_model(out_dir: str | Path, arch: str = "qwen2_vl", seed: int = 0) -> Path:
    """Build a tiny vision-language model and its processor and save both to ``out_dir``.

    The weights are float32, initialized from ``seed`` (the global RNG is left untouched).

    Args:
        out_dir: directory to write (created if missing).
        arch: ``"qwen2_vl"`` (Qwen2VLForConditionalGeneration), ``"qwen2_5_vl"``
            (Qwen2_5_VLForConditionalGeneration) or ``"qwen3_vl"``
            (Qwen3VLForConditionalGeneration).
        seed: initialization seed.

    Returns:
        ``out_dir`` as a ``Path``, loadable with ``AutoModelForImageTextToText`` and the
        family's processor (`lmrl.models.loading.load_processor`).
    Raises:
        ModelError: an unknown arch, or ``out_dir`` is a file or cannot be written.
    """
    from transformers import AutoModelForImageTextToText

    config = tiny_vl_config(arch)

    def processor(tokenizer):
        return processor_class(config)(
            build_image_processor(arch), tokenizer, chat_template=VL_CHAT_TEMPLATE
        )

    return init_and_save(
        AutoModelForImageTextToText, config, out_dir, seed, build_vl_tokenizer, processor
    )
