"""LoRA adapters through PEFT: wrap, save, load, merge for export.

With LoRA on, only the adapter trains and the reference policy is the actor itself with the
adapter disabled (see :mod:`lmrl.models.reference`), so no second copy of the weights is held.
Defaults follow verl: ``lora_rank = 0`` means no LoRA (the caller simply does not call
:func:`apply_lora`), ``lora_alpha = 16``, and ``target_modules = "all-linear"`` (PEFT's
shorthand for every linear layer except the output head). PEFT initializes the ``B`` matrices
to zero, so a fresh adapter leaves the model's outputs unchanged. On a vision-language model
the adapter sits in the language model only: the vision tower (frozen by default) is excluded
from every target, ``all-linear`` included, and a target that names only vision modules is
refused.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn

from lmrl.errors import ModelError
from lmrl.models.loading import ModelPathError, is_vision_language, vision_tower, weight_errors


def is_lora(model: nn.Module) -> bool:
    """True when ``model`` is PEFT-wrapped (its adapter can be disabled to get the base model)."""
    return isinstance(model, PeftModel)


def apply_lora(
    model: nn.Module,
    lora_rank: int,
    lora_alpha: float = 16,
    target_modules: str | Sequence[str] = "all-linear",
    lora_dropout: float = 0.0,
) -> PeftModel:
    """Wrap a causal LM with a fresh, trainable LoRA adapter (base weights frozen).

    Args:
        model: a Hugging Face causal LM.
        lora_rank: adapter rank ``r`` (> 0).
        lora_alpha: scaling numerator; the update is ``(lora_alpha / r) * B @ A``.
        target_modules: ``"all-linear"`` or module names (``["q_proj", "v_proj"]``).
        lora_dropout: dropout on the adapter's input.

    Returns:
        The ``PeftModel``; ``print_trainable_parameters()`` shows what trains.
    Raises:
        ModelError: a name of ``target_modules`` that matches no module of ``model``.
    """
    if is_lora(model):
        raise ValueError("model already has a LoRA adapter")
    if not isinstance(lora_rank, int) or lora_rank < 1:
        raise ValueError(f"lora_rank must be a positive int, got {lora_rank!r}")
    if lora_alpha <= 0:
        raise ValueError(f"lora_alpha must be > 0, got {lora_alpha}")
    if isinstance(target_modules, str) and target_modules != "all-linear":
        target_modules = [target_modules]
    if not isinstance(target_modules, str):
        check_lora_targets(model, list(target_modules), _model_name(model))
    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=lora_rank,
        lora_alpha=lora_alpha,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        lora_dropout=lora_dropout,
        bias="none",
        exclude_modules=_vision_regex(model),
    )
    with _peft_wraps():
        peft_model = get_peft_model(model, config)
    _draw_a_on_the_cpu(peft_model, torch.initial_seed())
    return peft_model


def check_lora_targets(model: nn.Module, targets: Sequence[str], where: str) -> None:
    """Refuse a LoRA target that names no module of ``model`` (PEFT would train the others,
    or, when none matches, fail with a traceback): a name matches a module whose dotted
    name is it or ends with ``.name``, as PEFT matches a list of names. The rule of
    ``lmrl train``, ``lmrl sft`` and ``lmrl train-flow`` alike.

    Raises:
        ModelError: naming the first target that matches nothing, and some module names.
    """
    modules = dict(model.named_modules())
    tower = _vision_regex(model)
    if tower is not None:  # a vision-language model: its language model's modules only
        modules = {n: m for n, m in modules.items() if not re.fullmatch(tower, n)}
        where = f"the language model of {where}"
    for target in targets:
        if not any(n == target or n.endswith("." + target) for n in modules):
            raise ModelError(
                f"model.target_modules: {target!r} matches no module of {where} (a LoRA of it "
                f"would train nothing); name modules such as {', '.join(_layer_names(modules))}"
            )


def _vision_regex(model: nn.Module) -> str | None:
    """A regular expression that PEFT full-matches against module names, matching the vision
    tower of a vision-language ``model`` and everything in it; None for a text model."""
    if not is_vision_language(getattr(model, "config", None)):
        return None
    name, _ = vision_tower(model)
    return rf"{re.escape(name)}(\..*)?"


def _layer_names(modules: dict[str, nn.Module], most: int = 12) -> list[str]:
    """Short names of the layers a LoRA can adapt (leaf modules with a matrix or a kernel):
    the last part of each name, two parts where it is an index (``to_out.0``)."""
    names = set()
    for name, module in modules.items():
        weight = getattr(module, "weight", None)
        leaf = name and not any(module.children())
        if leaf and isinstance(weight, torch.Tensor) and weight.dim() >= 2:
            parts = name.split(".")
            names.add(".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1])
    return sorted(names)[:most]


def _model_name(model: nn.Module) -> str:
    """``the model 'PATH'`` (``config._name_or_path``, as loaded), else its class name."""
    path = getattr(getattr(model, "config", None), "_name_or_path", None)
    return f"the model {path!r}" if path else type(model).__name__


@contextlib.contextmanager
def _peft_wraps() -> Iterator[None]:
    """Around PEFT's wrapping of a transformers model: PEFT asks the model
    ``getattr(model, "is_gradient_checkpointing", True)``, a property transformers 5 deprecated
    (a FutureWarning on every wrap, pointing at transformers) in favour of
    ``is_activation_checkpointing``, which it returns. The read is in ``PeftModel.__init__``
    (PEFT 0.21), which no PEFT API that wraps a model avoids, so this one warning is ignored
    here, where lmrl calls PEFT; any other warning passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        yield


def _draw_a_on_the_cpu(model: PeftModel, seed: int) -> None:
    """Redraw every ``A`` matrix with PEFT's own init (Kaiming-uniform, ``a = sqrt(5)``) from
    a CPU generator seeded with ``seed``.

    PEFT draws them from the RNG of the device the model is on, so the same seed gave another
    adapter on a GPU than on the CPU; drawn here they are the same on every device (and the
    same run, since the sampling is device-independent too).
    """
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if ".lora_A." in name:
            drawn = torch.empty(param.shape, dtype=torch.float32)
            nn.init.kaiming_uniform_(drawn, a=math.sqrt(5), generator=generator)
            with torch.no_grad():
                param.copy_(drawn)


def save_lora(model: PeftModel, out_dir: str | Path) -> Path:
    """Save only the adapter (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    if not is_lora(model):
        raise ValueError("save_lora needs a PEFT model; use save_pretrained for a full model")
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def load_lora(model: nn.Module, adapter_path: str | Path, is_trainable: bool = True) -> PeftModel:
    """Attach the adapter saved at ``adapter_path`` to the base model ``model``.

    Args:
        model: the base causal LM the adapter was trained on.
        adapter_path: a directory written by :func:`save_lora`.
        is_trainable: keep the adapter trainable (resume) rather than inference-only.
    Raises:
        ModelPathError: no adapter at ``adapter_path`` (also a ``FileNotFoundError``).
        ModelError: a damaged adapter file (named).
    """
    path = Path(adapter_path)
    if not (path / "adapter_config.json").is_file():
        raise ModelPathError(f"no LoRA adapter at {str(path)!r} (adapter_config.json missing)")
    with weight_errors(str(path), "LoRA adapter"), _peft_wraps():
        return PeftModel.from_pretrained(model, str(path), is_trainable=is_trainable)


def merge_lora(model: PeftModel, inplace: bool = False) -> nn.Module:
    """The base model with the adapter merged into its weights (a plain Hugging Face model).

    Args:
        model: a PEFT model.
        inplace: merge into ``model``'s own base weights (it cannot be trained further as a
            LoRA model); by default a copy is merged and ``model`` is left as it was.
    """
    if not is_lora(model):
        raise ValueError("merge_lora needs a PEFT model")
    target = model if inplace else copy.deepcopy(model)
    return target.merge_and_unload()


def export_merged(model: PeftModel, out_dir: str | Path, tokenizer=None) -> Path:
    """Write a merged, standalone model (and tokenizer) that ``load_causal_lm`` can load."""
    out = Path(out_dir)
    merge_lora(model).save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


_PEFT_PREFIX = "base_model.model."


def save_adapter(
    state: dict[str, torch.Tensor],
    out_dir: str | Path,
    lora_alpha: float,
    base_path: str | Path,
) -> Path:
    """Write the adapter of a PEFT LoRA state dict in PEFT's own format, from tensors alone.

    ``adapter_config.json`` and ``adapter_model.safetensors``, as ``PeftModel.save_pretrained``
    writes them: keys ``base_model.model.<module>.lora_A.weight`` (the adapter's name dropped),
    ``target_modules`` the adapted modules' own names, ``base_model_name_or_path`` the run's
    ``model.path`` (a local directory as an absolute path, so the adapter loads from anywhere;
    a hub id as it is). ``PeftModel.from_pretrained(base, out_dir)`` then loads it, on the base
    model without lmrl (vLLM's LoRA serving and ``peft`` users take this directory).

    Args:
        state: ``PeftModel.state_dict()``-style tensors (``lora_A.<adapter>.weight`` (r, in),
            ``lora_B.<adapter>.weight`` (out, r)), e.g. the actor's ``model_state``.
        lora_alpha: the run's ``model.lora_alpha`` (the rank is read from the tensors).
        base_path: the base model the adapter was trained on.
    Raises:
        ValueError: ``state`` holds no adapter.
    """
    from safetensors.torch import save_file

    adapter, modules, rank = {}, set(), None
    for key, tensor in state.items():
        for kind in ("lora_A", "lora_B"):
            if f".{kind}." in key:
                module, rest = key.split(f".{kind}.")
                adapter[f"{module}.{kind}.{rest.split('.')[-1]}"] = (
                    tensor.detach().contiguous().cpu()
                )
                modules.add(module.rsplit(".", 1)[-1])
                if kind == "lora_A":
                    rank = tensor.shape[0]
    if not adapter:
        raise ValueError("save_adapter: the state holds no LoRA adapter (no lora_A/lora_B keys)")
    config = LoraConfig(
        task_type="CAUSAL_LM", r=rank, lora_alpha=lora_alpha, target_modules=sorted(modules),
        lora_dropout=0.0, bias="none", base_model_name_or_path=base_model_id(base_path),
    )  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(adapter, out / "adapter_model.safetensors", metadata={"format": "pt"})
    return out


def base_model_id(path: str | Path) -> str:
    """``path`` as an adapter records its base model: a local directory made absolute (``~``
    expanded, ``..`` folded, symlinks kept); anything else (a hub id such as
    ``Qwen/Qwen2.5-0.5B``) as it is."""
    local = os.path.expanduser(str(path))
    return os.path.abspath(local) if os.path.exists(local) else str(path)


def adapter_export(state: dict[str, torch.Tensor], model_cfg):
    """``extra`` of ``export_pretrained`` for a LoRA run: writes ``<final>/adapter`` (PEFT's
    format, `save_adapter`) from ``state`` and the ``model`` config section's alpha and path."""
    return lambda final: save_adapter(
        state, final / "adapter", model_cfg.lora_alpha, model_cfg.path
    )


def merged_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A PEFT LoRA model's state dict as the plain model's, the adapters merged in.

    Works on the tensors alone (a checkpoint's, or weights gathered from sharded ranks), so an
    export needs no second copy of the model: for every adapted linear layer
    ``W = W_base + scaling * B @ A``, and the PEFT names lose their ``base_model.model.``
    prefix and ``.base_layer`` part. A state without adapters is returned unchanged.

    Args:
        state: ``PeftModel.state_dict()``-style tensors (``lora_A.<adapter>.weight`` (r, in),
            ``lora_B.<adapter>.weight`` (out, r)).
        scaling: ``lora_alpha / r`` (PEFT's scaling without rsLoRA).
    """
    if not any(k.startswith(_PEFT_PREFIX) for k in state):
        return dict(state)
    out: dict[str, torch.Tensor] = {}
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        name = key.removeprefix(_PEFT_PREFIX)
        if ".lora_A." in name or ".lora_B." in name:
            module, kind = name.split(".lora_")[0], name.split(".lora_")[1][0]
            adapters.setdefault(module, {})[kind] = tensor
            continue
        out[name.replace(".base_layer.", ".")] = tensor
    for module, ab in adapters.items():
        weight = out[f"{module}.weight"]
        delta = (ab["B"].double() @ ab["A"].double()) * scaling
        out[f"{module}.weight"] = (weight.double() + delta).to(weight.dtype)
    return out
