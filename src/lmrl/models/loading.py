"""Loading tokenizers and causal language models from ``model.path``.

One code path for every model: a local directory in Hugging Face format (a user's
``/path/to/Qwen2.5-0.5B-Instruct`` or a tiny model from :mod:`lmrl.models.tiny`) or a hub id
where a hub is reachable, through ``AutoTokenizer`` and ``AutoModelForCausalLM``. Remote code is
never run unless ``trust_remote_code=True`` is passed explicitly.

Choices:

- dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` (``fp32``/``bf16``/``fp16`` accepted) or
  ``"float64"`` (for exactness checks);
  ``None`` means float32 on CPU, where half precision is slow and inexact, and bfloat16 on a GPU
  (models that are only run, never trained; the trained ones load in their master dtype, see
  ``lmrl.workers.precision``). ``export_pretrained`` writes the weights' own dtype into
  ``config.json``.
- pad token: the tokenizer's own pad token if it has one, else its EOS token (as verl and TRL
  do). Not ``unk``: an unknown-token id is a real input the model may see, and sentencepiece
  tokenizers that have one usually also have an EOS. Padded positions are always masked out by
  ``attention_mask``/``response_mask``, so sharing the EOS id is harmless, provided masks are
  computed from positions and lengths, never by comparing ids with ``pad_token_id``. A tokenizer
  with neither pad nor EOS is an error (adding a token would change the vocabulary size).
- chat templates are left exactly as the tokenizer ships them.
- errors name the path, and the file where one is to blame (a truncated
  ``model.safetensors``): a ``lmrl.errors.ModelError``, which ``lmrl`` prints as one line.
- vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) load with their own function,
  `load_image_text_lm` (``AutoModelForImageTextToText``, the vision tower frozen by default),
  and their processor with `load_processor`; `load_causal_lm` refuses them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmrl.errors import ModelError

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,  # exactness checks (e.g. the Ray backend against one process)
}


class ModelPathError(FileNotFoundError, ModelError):
    """A model or tokenizer path that does not exist or cannot be loaded (both a
    ``FileNotFoundError`` and a ``ModelError``, so either kind of handler catches it)."""


def resolve_device(name: str) -> torch.device:
    """``trainer.device``: ``auto`` -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelError("trainer.device=cuda but CUDA is not available; use trainer.device=cpu")
    return torch.device(name)


def resolve_dtype(
    dtype: str | torch.dtype | None, device: str | torch.device = "cpu"
) -> torch.dtype:
    """The torch dtype for a config value; ``None`` or ``"auto"`` -> bfloat16 on a CUDA device
    that supports it, else float32."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")
        return dtype
    if dtype is None or dtype == "auto":
        cuda = torch.device(device).type == "cuda"
        return torch.bfloat16 if cuda and torch.cuda.is_bf16_supported() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def _looks_local(path: str) -> bool:
    """A path rather than a hub id ``org/name``: absolute, ``./``, ``~`` or more than one ``/``."""
    return (
        os.path.isabs(path)
        or path.startswith((".", "~"))
        or path.count("/") > 1
        or os.environ.get("HF_HUB_OFFLINE") == "1"
    )


def check_model_path(path: str | Path) -> str:
    """Return ``path`` as a string after checking that it can name a model.

    A local directory must exist and hold a ``config.json``; a hub id (``org/name``) is passed
    through when no offline mode is set. Raises :class:`ModelPathError` naming the path.
    """
    path = os.path.expanduser(str(path))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelPathError(
                f"model path {path!r} is a directory without a config.json: not a Hugging Face "
                "model directory (save one with save_pretrained, or build one with "
                "`lmrl tiny-model`)"
            )
        return path
    if os.path.exists(path):
        raise ModelPathError(f"model path {path!r} is a file; expected a model directory")
    if _looks_local(path):
        raise ModelPathError(
            f"model path {path!r} does not exist (and no model hub is reachable offline)"
        )
    return path


def set_pad_token(tokenizer):
    """Give ``tokenizer`` a pad token if it has none: its EOS token (see the module docstring)."""
    if tokenizer.pad_token is not None:
        return tokenizer
    if tokenizer.eos_token is None:
        raise ModelError(
            f"tokenizer of {tokenizer.name_or_path!r} has neither a pad nor an eos token; "
            "add a pad token to it (and resize the model's embeddings) before training"
        )
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """Load the tokenizer at ``path`` with ``AutoTokenizer``, with a pad token (see above).

    Args:
        path: local model directory or hub id.
        trust_remote_code: allow the repository's own Python code to run.

    Returns:
        The tokenizer, its chat template and padding side untouched.
    """
    from transformers import AutoTokenizer

    path = check_model_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelPathError(f"cannot load a tokenizer from {path!r}: {err}") from err
    return set_pad_token(tokenizer)


def load_config(path: str | Path, trust_remote_code: bool = False):
    """``AutoConfig`` of ``path``, with errors that name the path."""
    from transformers import AutoConfig

    path = check_model_path(path)
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise ModelPathError(f"cannot read a model config from {path!r}: {err}") from err


def _check_causal(path: str, config) -> None:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    auto_map = getattr(config, "auto_map", None) or {}
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or "AutoModelForCausalLM" in auto_map:
        return
    raise ModelError(
        f"model at {path!r} (model_type {config.model_type!r}, architectures "
        f"{getattr(config, 'architectures', None)}) is not a causal language model: "
        "AutoModelForCausalLM cannot load it"
    )


def load_causal_lm(
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
) -> nn.Module:
    """Load the causal LM at ``path`` (policy or reference) with ``AutoModelForCausalLM``.

    Args:
        path: local model directory or hub id.
        dtype: ``"float32"``/``"bfloat16"``/``"float16"``; None = float32 on CPU, bf16 on GPU.
        device: where to put it.
        trust_remote_code: allow the repository's own Python code to run.
        gradient_checkpointing: recompute activations in backward (non-reentrant).
        attn_implementation: e.g. ``"sdpa"``, ``"eager"``, ``"flash_attention_2"``; None = default.

    Returns:
        The model on ``device``, in eval mode as ``from_pretrained`` leaves it (the actor's
        update switches to train mode itself), with ``config.use_cache`` off when checkpointing.
    Raises:
        ModelError: a missing or unreadable path, a model that is not a causal LM, or a
            damaged weights file (named).
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load clutters every run's log
    path = check_model_path(path)
    config = load_config(path, trust_remote_code)
    _check_causal(path, config)
    return _pretrained(AutoModelForCausalLM, path, dtype, device, trust_remote_code,
                       attn_implementation, gradient_checkpointing)  # fmt: skip


def _pretrained(auto, path, dtype, device, trust_remote_code, attn_implementation,
                gradient_checkpointing):  # fmt: skip
    """``auto.from_pretrained`` of a checked ``path`` in ``dtype`` on ``device`` (weight
    errors named), gradient checkpointing on if asked."""
    kwargs = {"dtype": resolve_dtype(dtype, device), "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with weight_errors(path, "model"):
        model = auto.from_pretrained(path, **kwargs)
    model.to(device)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model


@contextmanager
def weight_errors(path: str, what: str = "model") -> Iterator[None]:
    """Turn the errors of a ``from_pretrained`` of ``path`` into a ``ModelError`` that names
    the path, and the weights file when one is damaged (safetensors' own error names none).

    Args:
        path: the model directory being loaded.
        what: the noun of the message (``"model"``, ``"critic"``).
    """
    from safetensors import SafetensorError

    try:
        yield
    except OSError as err:
        raise ModelPathError(f"cannot load {what} weights from {path!r}: {err}") from err
    except SafetensorError as err:
        file = _damaged_safetensors(path)
        where = f"{file} is" if file else f"a weights file in {path!r} is"
        raise ModelError(
            f"cannot load {what} weights: {where} damaged or truncated ({err}); save or copy "
            "the model again"
        ) from None


def _damaged_safetensors(path: str) -> Path | None:
    """The first ``*.safetensors`` file in ``path`` whose header or size does not check out."""
    from safetensors import SafetensorError, safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt"):
                pass
        except (SafetensorError, OSError):
            return file
    return None


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Turn on (non-reentrant) activation checkpointing and turn off the KV cache in training.

    ``transformers`` 5 renamed ``gradient_checkpointing_enable`` to
    ``activation_checkpointing_enable``; both are supported.
    """
    kwargs = {"use_reentrant": False}
    if callable(getattr(model, "activation_checkpointing_enable", None)):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False


def freeze(model: nn.Module) -> nn.Module:
    """Put ``model`` in eval mode with every parameter's ``requires_grad`` off; returns it."""
    model.requires_grad_(False)
    return model.eval()


def export_pretrained(
    out_dir: str | Path,
    weights: dict[str, torch.Tensor],
    base_path: str | Path,
    tokenizer=None,
    trust_remote_code: bool = False,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``weights`` as a plain Hugging Face model directory that ``model.path`` loads.

    The architecture (``config.json``, and ``generation_config.json`` when the base has one)
    comes from ``base_path``, the model the weights were trained from; only tensors travel,
    so weights gathered from Ray ranks export as well as an in-process model's. Written into
    ``<out_dir>.tmp`` and renamed, so a killed run never leaves a half-written directory.

    Args:
        weights: full weights under the model's own names (LoRA merged, see
            ``lmrl.models.lora.merged_state``); a tied output head may be absent.
        base_path: the ``model.path`` of the run.
        tokenizer: saved alongside when given.
        extra: ``extra(dir)`` writes more into the directory before it is renamed into place
            (a LoRA run's ``adapter/``, `lmrl.models.lora.save_adapter`).
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    floating = {v.dtype for v in weights.values() if v.is_floating_point()}

    def write(tmp: Path) -> None:
        config = load_config(base_path, trust_remote_code)
        config.use_cache = True
        if len(floating) == 1:  # the weights' own dtype (the masters'), not the base's
            config.dtype = next(iter(floating))
        config.save_pretrained(tmp)
        with contextlib.suppress(OSError):  # the base has no generation_config.json
            GenerationConfig.from_pretrained(str(base_path)).save_pretrained(tmp)
        tensors = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if extra is not None:
            extra(tmp)

    return write_dir_atomically(out_dir, write)


def write_dir_atomically(out: str | Path, write) -> Path:
    """Build the directory ``out`` with ``write(tmp)`` in a temporary sibling
    (``.<name>.tmp``), then rename it into place (replacing an older ``out``): a run killed
    meanwhile never leaves a half-written ``out``."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def weights_version(model: nn.Module) -> int:
    """How many times the trainer has changed ``model``'s weights (updates and loads).

    Counted explicitly: the fused optimizer kernels write parameters without bumping torch's
    per-tensor version counters, so those cannot tell an engine that the weights moved.
    """
    return getattr(model, "_lmrl_weights_version", 0)


def bump_weights_version(model: nn.Module) -> None:
    model._lmrl_weights_version = weights_version(model) + 1


def refuse_other_shapes(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Refuse full weights of another model before loading them, in one line.

    torch's ``load_state_dict`` reports a size mismatch a line per tensor (48 lines for a
    small Qwen2); this names the first tensor and counts the rest. ``state``'s tensors are
    full (unsharded); an FSDP2 model's parameters are DTensors whose ``shape`` is the full one.

    Raises:
        ValueError: "weights of another model: <name> is (a, b), the model's (c, d) (and N
            more)" (the run loop's resume names the checkpoint around it).
    """
    current = model.state_dict()
    shapes = [f"{n} is {tuple(t.shape)}, the model's {tuple(current[n].shape)}"
              for n, t in state.items() if n in current and current[n].shape != t.shape]  # fmt: skip
    if shapes:
        more = f" (and {len(shapes) - 1} more)" if len(shapes) > 1 else ""
        raise ValueError(f"weights of another model: {shapes[0]}{more}")


# ---------------------------------------------------------------------------- vision-language
# Where each family keeps its vision tower (the patch embedding, its blocks and the merger that
# projects into the language model) under the ``*ForConditionalGeneration`` head: Qwen2-VL,
# Qwen2.5-VL and Qwen3-VL as ``model.visual`` (beside ``model.language_model``).
VISION_TOWERS = ("model.visual", "visual", "model.vision_tower", "vision_tower")


def is_vision_language(config) -> bool:
    """True when ``config`` (an ``AutoConfig``) is an image-text-to-text model with a vision
    tower (``vision_config``): Qwen2-VL, Qwen2.5-VL, Qwen3-VL..."""
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    return (
        type(config) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
        and getattr(config, "vision_config", None) is not None
    )


def load_image_text_lm(
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
    freeze_vision: bool = True,
) -> nn.Module:
    """Load the vision-language model at ``path`` with ``AutoModelForImageTextToText``.

    The arguments are `load_causal_lm`'s, plus ``freeze_vision`` (``actor.freeze_vision_tower``,
    verl's key): the vision tower's parameters get ``requires_grad`` off, so only the language
    model trains (`freeze_vision_tower`).

    Raises:
        ModelError: a missing or unreadable path, a model without a vision tower (a text model
            loads with `load_causal_lm`), or a damaged weights file (named).
    """
    from transformers import AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = check_model_path(path)
    config = load_config(path, trust_remote_code)
    if not is_vision_language(config):
        raise ModelError(
            f"model at {path!r} (model_type {config.model_type!r}, architectures "
            f"{getattr(config, 'architectures', None)}) is not an image-text-to-text model with "
            "a vision tower; a text model loads as a causal LM"
        )
    model = _pretrained(AutoModelForImageTextToText, path, dtype, device, trust_remote_code,
                        attn_implementation, gradient_checkpointing)  # fmt: skip
    if freeze_vision:
        freeze_vision_tower(model)
    return model


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (``base_model.model``), else ``model``."""
    from peft import PeftModel

    return model.get_base_model() if isinstance(model, PeftModel) else model


def vision_tower(model: nn.Module) -> tuple[str, nn.Module]:
    """``(dotted name, module)`` of a vision-language model's vision tower (a PEFT wrapper is
    looked through): ``model.visual`` for Qwen2-VL, Qwen2.5-VL and Qwen3-VL.

    Raises:
        ModelError: no vision tower where the known families keep one.
    """
    model = _unwrap(model)
    for name in VISION_TOWERS:
        try:
            return name, model.get_submodule(name)
        except AttributeError:
            continue
    raise ModelError(
        f"{type(model).__name__} has no vision tower under any of {list(VISION_TOWERS)}: not a "
        "vision-language model lmrl knows"
    )


def freeze_vision_tower(model: nn.Module) -> int:
    """Turn ``requires_grad`` off on every parameter of ``model``'s vision tower (verl's
    ``freeze_vision_tower``); the language model and output head are left as they are.

    Returns:
        How many parameters (elements) were frozen.
    """
    _, tower = vision_tower(model)
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def processor_class(config) -> type:
    """The processor class of a vision-language ``config``'s family (``Qwen2VLProcessor``...),
    taking images only: transformers builds video processors only where torchvision is
    installed, and lmrl's prompts hold images, not videos. The class keeps the family's name,
    so a saved processor records the real class and ``AutoProcessor`` loads it elsewhere.

    Raises:
        ModelError: a model type without a processor class in transformers.
    """
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    try:
        base: Any = PROCESSOR_MAPPING[type(config)]
    except KeyError:
        raise ModelError(
            f"transformers has no processor for model_type {config.model_type!r}"
        ) from None

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": base.__module__})


def load_processor(path: str | Path, trust_remote_code: bool = False):
    """Load the processor (tokenizer, image processor, chat template) of the vision-language
    model at ``path``, images only (`processor_class`), with a pad token.

    Raises:
        ModelError: a missing path, a model that is not vision-language, or a directory
            without an image processor (``preprocessor_config.json``) or tokenizer.
    """
    path = check_model_path(path)
    config = load_config(path, trust_remote_code)
    if not is_vision_language(config):
        raise ModelError(
            f"model at {path!r} (model_type {config.model_type!r}) has no vision tower, so no "
            "image processor; a text model takes its tokenizer only"
        )
    try:
        processor = processor_class(config).from_pretrained(  # type: ignore[attr-defined]
            path, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise ModelPathError(f"cannot load a processor from {path!r}: {err}") from err
    set_pad_token(processor.tokenizer)
    return processor
