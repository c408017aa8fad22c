"""SD3 pipelines of random weights built from configs, saved as a diffusers directory that
``lmrl train-flow model.path=DIR`` loads exactly as a user's SD3.5 (tests, benchmarks; no hub).

Two shapes (`SHAPES`): ``tiny`` (two 2-layer CLIPs of width 32, a 1-layer T5, a 2-block
transformer, a 2-level VAE with SD3's 16 latent channels: seconds on a CPU) and
``sd35-medium`` (Stable Diffusion 3.5 Medium's transformer: 24 blocks of 24 heads x 64, the
dual attention of its first 13 blocks, RMS q/k norm: 2.24B parameters; SD3's VAE; text
encoders of the real widths (CLIP-L 768, CLIP-G 1280, T5-XXL 4096) but one layer each, so the
transformer sees the embeddings it would and the encoders cost little). The tokenizers are
character-level (lower-case letters): prompts of other characters encode as unknowns.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

__all__ = ["SHAPES", "build_random_sd3"]

LETTERS = "abcdefghijklmnopqrstuvwxyz"

#: per shape: the CLIP widths, the T5 width, the transformer's and the VAE's arguments
SHAPES = {
    "tiny": dict(
        clip=(32, 32), t5=32, transformer=dict(
            sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
            caption_projection_dim=16, pooled_projection_dim=64, pos_embed_max_size=16,
        ),
        vae=dict(block_out_channels=(8, 8), norm_num_groups=4, sample_size=16),
    ),
    "sd35-medium": dict(
        clip=(768, 1280), t5=4096, transformer=dict(
            sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
            attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
            caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
            dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
        ),
        vae=dict(block_out_channels=(128, 256, 512, 512), norm_num_groups=32, sample_size=1024),
    ),
}  # fmt: skip


def build_random_sd3(out: str | Path, shape: str = "tiny", t5: bool = True) -> Path:
    """Write a ``StableDiffusion3Pipeline`` of random weights of ``shape`` (`SHAPES`) to
    ``out``; ``t5=False`` leaves the T5 encoder out (SD3 then encodes its part as zeros)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        CLIPTokenizer,
        T5Config,
        T5EncoderModel,
        T5TokenizerFast,
    )

    out = Path(out)
    spec = SHAPES[shape]
    torch.manual_seed(0)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in LETTERS:  # characters, no merges: a character-level CLIP BPE
        vocab[ch], vocab[ch + "</w>"] = len(vocab), len(vocab) + 1
    words = out.parent / f"{out.name}_clip_vocab"
    words.mkdir(parents=True, exist_ok=True)
    (words / "vocab.json").write_text(json.dumps(vocab))
    (words / "merges.txt").write_text("#version: 0.2\n")
    clip_tokenizer = CLIPTokenizer(
        str(words / "vocab.json"), str(words / "merges.txt"), model_max_length=77
    )

    def clip(width: int):
        layers = 2 if shape == "tiny" else 1
        return CLIPTextModelWithProjection(
            CLIPTextConfig(
                vocab_size=len(vocab), hidden_size=width, intermediate_size=width + 5,
                num_hidden_layers=layers, num_attention_heads=2, max_position_embeddings=77,
                projection_dim=width, bos_token_id=0, eos_token_id=1, pad_token_id=1,
            )
        )  # fmt: skip

    t5_model = t5_tokenizer = None
    if t5:
        pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
        pieces += [(c, -1.0) for c in "\u2581" + LETTERS]
        core = Tokenizer(models.Unigram(pieces, unk_id=2))
        core.pre_tokenizer = pre_tokenizers.Metaspace()
        t5_tokenizer = T5TokenizerFast(
            tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
            extra_ids=0,
        )  # fmt: skip
        width = spec["t5"]
        t5_config = T5Config(
            vocab_size=len(pieces), d_model=width, d_ff=width + 5, d_kv=8, num_layers=1,
            num_heads=2, decoder_start_token_id=0,
        )  # fmt: skip
        t5_model = T5EncoderModel(t5_config)
    transformer = SD3Transformer2DModel(**spec["transformer"])
    levels = len(spec["vae"]["block_out_channels"])
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels, layers_per_block=1 if shape == "tiny" else 2,
        latent_channels=16, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
        use_post_quant_conv=False, **spec["vae"],
    )  # fmt: skip
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
        text_encoder=clip(spec["clip"][0]), tokenizer=clip_tokenizer,
        text_encoder_2=clip(spec["clip"][1]), tokenizer_2=clip_tokenizer,
        text_encoder_3=t5_model, tokenizer_3=t5_tokenizer,
    )  # fmt: skip
    pipe.save_pretrained(out)
    return out
