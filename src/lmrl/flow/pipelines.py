"""Image pipelines: what ``lmrl train-flow`` trains, how a prompt row becomes its conditioning,
and how a sample becomes pixels for the reward and the grids.

A pipeline holds the trained velocity model ``model(x, t, cond)`` (`lmrl.flow.rollout`) and
the frozen parts around it. Its methods are the whole seam the trainer uses:

- ``cond(rows)`` (B, ...): the conditioning of B prompt rows; ``uncond(cond)``: classifier-free
  guidance's unconditional input of the same shape;
- ``image_shape``: ``(C, H, W)`` of the sampled tensor (pixels, or latents);
- ``decode(samples)`` (B, 3, H', W') in [0, 1] on the CPU: what rewards score and grids show;
- ``add_lora(config)``: wrap the trained weights with a PEFT LoRA (the reference is the
  adapter switched off: ``model.disable_adapter()``);
- ``export(model, out)``: what ``final/`` holds.

Two kinds, told apart by the directory ``model.path`` names (`load_pipeline`):

- `AttributePipeline`: lmrl's own `ImageFlow` (no ``model_index.json``): pixels in [-1, 1],
  conditioned on the ``shapes`` prompts' attribute vectors; the unconditional input is zeros.
- `SD3Pipeline`: a diffusers ``StableDiffusion3Pipeline`` directory (SD3, SD3.5): the
  transformer is trained in the VAE's latent space (16, res/8, res/8); each prompt is encoded
  by the CLIP and T5 encoders and cached (the last 512 used); ``cond`` packs a row's text embeddings and
  pooled embedding in one tensor (B, L + 1, W) (``W`` = max of the two widths) so that a
  `Batch` slices it like any tensor; ``uncond`` is the negative prompt's. ``t`` in [0, 1] is
  SD3's timestep / 1000 (both predict ``noise - data``). A FLUX-style pipeline is another
  class of the same methods (its own encoders, packing and velocity) and a line in
  ``PIPELINES``.
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lmrl.errors import DataError, ModelError
from lmrl.models.lora import check_lora_targets  # the rule of every command's LoRA

__all__ = [
    "PIPELINES",
    "AttributePipeline",
    "SD3Pipeline",
    "SD3Velocity",
    "check_lora_targets",
    "load_lora_weights",
    "load_pipeline",
    "read_model_index",
]

# Flow-GRPO's SD3 LoRA (scripts/train_sd3.py): the joint attention's projections, both streams
SD3_LORA_TARGETS = [
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
]  # fmt: skip
IMAGE_FLOW_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"]


def load_lora_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Start the LoRA of ``model`` (wrapped by ``add_lora``) from a PEFT adapter directory
    (``adapter_config.json``, ``adapter_model.safetensors``: an SD3 run's ``final/``, or
    Flow-GRPO's ``train.lora_path``).

    Raises:
        ModelError: no adapter there, or one of another rank or other modules.
    """
    from peft import PeftModel, set_peft_model_state_dict
    from safetensors.torch import load_file

    where = Path(path)
    config, weights = where / "adapter_config.json", where / "adapter_model.safetensors"
    if not (config.is_file() and weights.is_file()):
        raise ModelError(
            f"model.lora_path={where}: not a PEFT adapter directory (adapter_config.json and "
            "adapter_model.safetensors)"
        )
    peft = model if isinstance(model, PeftModel) else model.transformer
    saved = json.loads(config.read_text())
    mine = peft.peft_config["default"]
    if saved.get("r") != mine.r or set(saved.get("target_modules") or ()) != set(
        mine.target_modules
    ):
        raise ModelError(
            f"model.lora_path={where} is an adapter of rank {saved.get('r')} on "
            f"{sorted(saved.get('target_modules') or ())}; this run's LoRA is rank {mine.r} on "
            f"{sorted(mine.target_modules)} (set model.lora_rank and model.target_modules to "
            "the adapter's)"
        )
    result = set_peft_model_state_dict(peft, load_file(weights))
    if result.unexpected_keys:
        raise ModelError(
            f"model.lora_path={where}: {len(result.unexpected_keys)} of its weights fit no "
            f"module of this model (first: {result.unexpected_keys[0]})"
        )


def _lora(model: torch.nn.Module, settings: dict, where: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    check_lora_targets(model, settings["target_modules"], where)
    return get_peft_model(model, LoraConfig(**settings))


class AttributePipeline:
    """lmrl's `ImageFlow`: pixels in [-1, 1], conditioned on the shapes prompts' attributes.

    Args:
        model: the image model (on its device).
        device: where it computes.
    """

    default_targets = IMAGE_FLOW_LORA_TARGETS
    lora_only_checkpoints = False  # a checkpoint holds every weight (the model is small)

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        c = model.config
        self.model, self.device = model, device
        self.image_shape = (c["channels"], c["image_size"], c["image_size"])

    def check_prompts(self, rows: list[dict], files: Any) -> None:
        """Raises DataError: rows without the attributes the model is conditioned on."""
        if any("attributes" not in r for r in rows):
            raise DataError(
                f"the prompts of {files} are text only, and model.path is an attribute-"
                "conditioned ImageFlow (it reads the shapes task's parquet rows); text prompts "
                "need a text-conditioned pipeline (a StableDiffusion3Pipeline directory)"
            )

    def cond(self, rows: list[dict]) -> torch.Tensor:
        from lmrl.data.shapes import attribute_vector

        vectors = np.stack([attribute_vector(r["attributes"]) for r in rows])
        return torch.tensor(vectors, device=self.device)

    def uncond(self, cond: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(cond)

    def decode(self, samples: torch.Tensor) -> torch.Tensor:
        return ((samples.cpu() + 1) / 2).clamp(0, 1)

    def add_lora(self, settings: dict) -> torch.nn.Module:
        return _lora(self.model, settings, "the image model")

    def export(self, model: torch.nn.Module, out: Path, lora: bool) -> None:
        """``out``: the image model (LoRA merged), loadable as another run's model.path."""
        model = copy.deepcopy(model).to("cpu")
        (model.merge_and_unload() if lora else model).save(out)


class SD3Velocity(torch.nn.Module):
    """``(x, t, cond) -> velocity`` over an SD3 transformer (see the module docstring).

    Args:
        transformer: ``SD3Transformer2DModel`` (or its PEFT wrapper).
        text_width, pooled_width: the widths packed in ``cond`` (B, L + 1, W).
    """

    def __init__(self, transformer: torch.nn.Module, text_width: int, pooled_width: int) -> None:
        super().__init__()
        self.transformer, self.text_width, self.pooled_width = transformer, text_width, pooled_width

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        out = self.transformer(
            hidden_states=x,
            timestep=t * 1000,
            encoder_hidden_states=cond[:, :-1, : self.text_width],
            pooled_projections=cond[:, -1, : self.pooled_width],
            return_dict=False,
        )[0]
        return out.float()

    def disable_adapter(self):
        """The LoRA switched off (the reference), as a context manager."""
        return self.transformer.disable_adapter()


CACHED_PROMPTS = 512  # encodings an SD3Pipeline keeps (least recently used dropped)

# the components a StableDiffusion3Pipeline needs (text_encoder_3 / tokenizer_3 may be null:
# SD3 then encodes T5's part as zeros)
SD3_REQUIRED = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer", "text_encoder_2",
                "tokenizer_2")  # fmt: skip


class SD3Pipeline:
    """A diffusers ``StableDiffusion3Pipeline`` directory (see the module docstring).

    Args:
        path: the directory (``model_index.json`` and its components' folders).
        device: where the transformer, the encoders and the VAE compute.
        frozen_dtype: dtype of the text encoders and the VAE (they never train).
        resolution: image side in pixels; None = the transformer's default.
        negative_prompt: the unconditional input of guidance ("" as Flow-GRPO).
        max_sequence_length: T5 tokens of a prompt.

    Raises:
        ModelError: a missing component, or a resolution the model cannot take.
    """

    default_targets = SD3_LORA_TARGETS
    lora_only_checkpoints = True  # with LoRA a checkpoint holds the adapters (the base is frozen)

    def __init__(
        self,
        path: str | Path,
        device: torch.device,
        frozen_dtype: torch.dtype = torch.float32,
        resolution: int | None = None,
        negative_prompt: str = "",
        max_sequence_length: int = 128,
    ) -> None:
        from diffusers import StableDiffusion3Pipeline

        where = Path(path)
        index = read_model_index(where)
        if index is None:
            raise ModelError(f"model.path={where}: no model_index.json (not a diffusers pipeline)")
        for name in SD3_REQUIRED:
            spec = index.get(name)
            if not spec or spec[0] is None:
                raise ModelError(f"model.path={where}: the pipeline has no {name} (SD3 needs it)")
        for name, spec in index.items():
            if isinstance(spec, list) and spec[0] is not None and not (where / name).is_dir():
                raise ModelError(
                    f"model.path={where}: the pipeline's {name} ({spec[1]}) is missing "
                    f"(no {name}/ folder)"
                )
        try:
            absent = {k: None for k, v in index.items() if isinstance(v, list) and v[0] is None}
            pipe = StableDiffusion3Pipeline.from_pretrained(where, dtype=frozen_dtype, **absent)
        except (OSError, ValueError, TypeError, RuntimeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ModelError(f"cannot load the SD3 pipeline in {where}: {first}") from None
        pipe.set_progress_bar_config(disable=True)
        self.frozen_dtype = frozen_dtype
        transformer = pipe.transformer.to(device)
        if transformer.dtype != torch.float32:  # the trained weights are float32 masters
            transformer = transformer.float()
        for part in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3, pipe.vae):
            if part is not None:
                part.to(device).requires_grad_(False).eval()
        self.pipe, self.device, self.path = pipe, device, where
        self.negative_prompt, self.max_sequence_length = negative_prompt, max_sequence_length
        factor = pipe.vae_scale_factor * transformer.config.patch_size
        resolution = resolution or pipe.default_sample_size * pipe.vae_scale_factor
        if resolution % factor:
            raise ModelError(
                f"model.resolution={resolution} must be a multiple of {factor} (the VAE's "
                f"{pipe.vae_scale_factor}x down-sampling times the transformer's patch size)"
            )
        most = (transformer.config.pos_embed_max_size or 0) * factor
        if most and resolution > most:
            raise ModelError(
                f"model.resolution={resolution} is more than the transformer's positions "
                f"cover ({transformer.config.pos_embed_max_size} patches a side: {most} pixels)"
            )
        side = resolution // pipe.vae_scale_factor
        self.image_shape = (transformer.config.in_channels, side, side)
        self.text_width = transformer.config.joint_attention_dim
        self.pooled_width = transformer.config.pooled_projection_dim
        self.model = SD3Velocity(transformer, self.text_width, self.pooled_width)
        self.scheduler_shift = float(pipe.scheduler.config.get("shift", 1.0))
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    @torch.no_grad()
    def _encode(self, prompt: str) -> torch.Tensor:
        """(L + 1, W) float32 on the CPU: the prompt's text embeddings and its pooled one,
        encoded once and kept while among the last ``CACHED_PROMPTS`` used (SD3's 205 x 4096
        floats are 3.4 MB a prompt: a whole prompt set may not fit)."""
        if prompt in self._cache:
            self._cache.move_to_end(prompt)
        else:
            embeds, _, pooled, _ = self.pipe.encode_prompt(
                prompt, None, None, device=self.device, do_classifier_free_guidance=False,
                max_sequence_length=self.max_sequence_length,
            )  # fmt: skip
            width = max(self.text_width, self.pooled_width)
            packed = torch.zeros(embeds.shape[1] + 1, width)
            packed[:-1, : self.text_width] = embeds[0].float().cpu()
            packed[-1, : self.pooled_width] = pooled[0].float().cpu()
            self._cache[prompt] = packed
            if len(self._cache) > CACHED_PROMPTS:
                self._cache.popitem(last=False)
        return self._cache[prompt]

    def check_prompts(self, rows: list[dict], files: Any) -> None:
        """Any text prompt works."""

    def cond(self, rows: list[dict]) -> torch.Tensor:
        return torch.stack([self._encode(r["prompt"]) for r in rows]).to(self.device)

    def uncond(self, cond: torch.Tensor) -> torch.Tensor:
        negative = self._encode(self.negative_prompt).to(self.device)
        return negative.expand(cond.shape[0], *negative.shape).clone()

    @torch.no_grad()
    def decode(self, samples: torch.Tensor, chunk: int = 8) -> torch.Tensor:
        """Latents (B, 16, h, w) -> pixels (B, 3, 8h, 8w) in [0, 1] on the CPU."""
        vae = self.pipe.vae
        scale, shift = vae.config.scaling_factor, vae.config.shift_factor or 0.0
        out = []
        for part in samples.split(chunk):
            latents = (part / scale + shift).to(self.device, vae.dtype)
            out.append(vae.decode(latents, return_dict=False)[0].float().cpu())
        return ((torch.cat(out) + 1) / 2).clamp(0, 1)

    def add_lora(self, settings: dict) -> torch.nn.Module:
        """The transformer wrapped with PEFT LoRA (Flow-GRPO initializes it "gaussian"); under
        bf16/fp16 compute its frozen base weights are kept in that dtype, as Flow-GRPO does
        (the adapters, the only trained weights, are fp32 masters)."""
        settings = {"init_lora_weights": "gaussian", **settings}
        self.model.transformer = _lora(self.model.transformer, settings, "the SD3 transformer")
        if self.frozen_dtype != torch.float32:  # the frozen base in the compute dtype (half
            for p in self.model.transformer.parameters():  # its memory); adapters stay fp32
                if not p.requires_grad:
                    p.data = p.data.to(self.frozen_dtype)
        return self.model

    def export(self, model: torch.nn.Module, out: Path, lora: bool) -> None:
        """``out``: the LoRA adapter in PEFT's format (``adapter_config.json``,
        ``adapter_model.safetensors``; ``PeftModel.from_pretrained(transformer, out)``), or
        without LoRA the transformer (``SD3Transformer2DModel.from_pretrained(out)``)."""
        model.transformer.save_pretrained(out)


PIPELINES = {"StableDiffusion3Pipeline": SD3Pipeline}


def _read_json(path: Path) -> Any:
    """A model directory's JSON file, parsed.

    Raises:
        ModelError: one line naming the file: unreadable, or not valid JSON (the parse error).
    """
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise ModelError(f"cannot read {path}: {err}") from None
    except ValueError as err:
        raise ModelError(f"cannot read {path}: not valid JSON ({err})") from None


def read_model_index(path: str | Path) -> dict[str, Any] | None:
    """The ``model_index.json`` of a diffusers pipeline directory as a dict, or None when
    ``path`` holds none.

    Raises:
        ModelError: a ``model_index.json`` that cannot be read, is not valid JSON or not a JSON
            object (one line naming the file and the parse error).
    """
    index = Path(path) / "model_index.json"
    if not index.is_file():
        return None
    found = _read_json(index)
    if not isinstance(found, dict):
        raise ModelError(
            f"cannot read {index}: a diffusers model_index.json is a JSON object, this one is "
            f"a {type(found).__name__}"
        )
    return found


def load_pipeline(
    path: str | Path,
    device: torch.device,
    *,
    frozen_dtype: torch.dtype = torch.float32,
    resolution: int | None = None,
    negative_prompt: str = "",
    max_sequence_length: int = 128,
) -> AttributePipeline | SD3Pipeline:
    """The pipeline of the directory ``path``: a diffusers pipeline by its ``model_index.json``'s
    ``_class_name`` (``PIPELINES``), else lmrl's `ImageFlow`.

    Raises:
        ModelError: a diffusers pipeline of another kind, a transformers model, a missing
            component, a ``model_index.json`` or ``config.json`` that is not valid JSON (naming
            the file and the parse error), or no image model at all (one line naming what was
            found).
    """
    where = Path(path)
    index = read_model_index(where)
    if index is not None:
        kind = index.get("_class_name")
        if kind not in PIPELINES:
            raise ModelError(
                f"model.path={where} holds a diffusers "
                f"{kind or 'pipeline of unknown kind (model_index.json names no _class_name)'}; "
                f"lmrl train-flow trains {', '.join(PIPELINES)} directories (SD3, SD3.5) or an "
                "lmrl ImageFlow"
            )
        return PIPELINES[kind](
            where, device, frozen_dtype=frozen_dtype, resolution=resolution,
            negative_prompt=negative_prompt, max_sequence_length=max_sequence_length,
        )  # fmt: skip
    config = where / "config.json"
    if config.is_file():
        found = _read_json(config)
        if isinstance(found, dict) and found.get("type") != "lmrl-image-flow":
            what = found.get("model_type") or found.get("_class_name") or "model"
            raise ModelError(
                f"model.path={where} holds a {what} model, not an image pipeline: give a "
                "StableDiffusion3Pipeline directory (model_index.json) or an lmrl ImageFlow"
            )
    from lmrl.flow.image_model import ImageFlow

    model = ImageFlow.load(where)
    if resolution is not None and resolution != model.config["image_size"]:
        raise ModelError(
            f"model.resolution={resolution}, but the ImageFlow in {where} makes "
            f"{model.config['image_size']}-pixel images"
        )
    return AttributePipeline(model.to(device), device)
