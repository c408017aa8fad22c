"""The critic: a scalar value per token, for PPO with GAE.

Choice: the critic is ``AutoModelForTokenClassification`` with one label, the backbone of a
causal LM topped by a linear ``score`` head (``hidden -> 1``), as verl does. Loaded from a
causal-LM checkpoint (the actor's ``model.path``, the default), the backbone takes the actor's
weights, its output head is dropped, and the new ``score`` head is initialized to zero, so every
initial value is 0 (the scale of a reward baseline of nothing) instead of noise of arbitrary
scale. A critic saved with ``save_pretrained`` is a standard token-classification checkpoint and
loads back from its own path with its trained head. Dropout before the head is off.

The value of response token ``t`` is the head's output at position ``P - 1 + t``, the state
from which token ``t`` is generated (the same alignment as the log-probs).

Shared prompts, as for the log-probs (``lmrl.models.forward``): when rows of a micro-batch
share their prompt (GRPO-style groups, ``rollout.n > 1``), the backbone runs each distinct
prompt once and only the response tokens per row, and the value head is applied to those
hidden states (`value_head`; packed with its responses where that pays, `group_hidden`). A PPO
step's critic forward and backward then cost what the actor's do instead of ``n`` full passes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lmrl.errors import ModelError
from lmrl.models.forward import (
    can_share_prompts,
    eval_mode,
    group_hidden,
    own_mask,
    plain_head,
)
from lmrl.models.layout import (
    MICRO_KEYS,
    check_keys,
    micro_batches,
    on_device,
    prompt_groups,
    trim_batch,
)
from lmrl.models.loading import (
    ModelPathError,
    check_model_path,
    enable_gradient_checkpointing,
    load_config,
    resolve_dtype,
)


def load_critic(
    path: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
) -> nn.Module:
    """Load a critic from a causal-LM checkpoint (new zero head) or a saved critic.

    Args:
        path: the actor's model directory, or a directory a critic was saved to.
        dtype: ``"float32"``/``"bfloat16"``/``"float16"``; None = float32 on CPU, bf16 on GPU.
        device: where to put it.
        trust_remote_code: allow the repository's own Python code to run.
        gradient_checkpointing: recompute activations in backward.

    Returns:
        A ``*ForTokenClassification`` model with ``num_labels == 1``.
    """
    from transformers import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    path = check_model_path(path)
    config = load_config(path, trust_remote_code)
    auto_map = getattr(config, "auto_map", None) or {}
    if (
        type(config) not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING
        and "AutoModelForTokenClassification" not in auto_map
    ):
        raise ModelError(
            f"model at {path!r} (model_type {config.model_type!r}) has no token-classification "
            "head class in transformers, so no critic can be built from it"
        )
    config.num_labels = 1
    config.classifier_dropout = 0.0  # no dropout between the backbone and the value head
    quiet = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the new head's "MISSING" load report is expected
    try:
        critic, info = AutoModelForTokenClassification.from_pretrained(
            path,
            config=config,
            dtype=resolve_dtype(dtype, device),
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
        )
    except OSError as err:
        raise ModelPathError(f"cannot load critic weights from {path!r}: {err}") from err
    finally:
        hf_logging.set_verbosity(quiet)
    # Parameters outside the backbone that the checkpoint lacks: the new value head.
    params = dict(critic.named_parameters())
    fresh = [k for k in info["missing_keys"] if k.split(".")[0] != critic.base_model_prefix]
    with torch.no_grad():
        for key in fresh:
            if key in params:
                params[key].zero_()
    critic.to(device)
    if gradient_checkpointing:
        enable_gradient_checkpointing(critic)
    return critic


def value_head(critic: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """``(backbone, score)`` when the critic's values are exactly ``score(backbone(x))``: the
    ``score`` head of transformers' decoder token-classification models, plain
    (`lmrl.models.forward.plain_head`), no active dropout before it, and a backbone that can
    share prompts (`lmrl.models.forward.can_share_prompts`); None when the critic's own
    forward must run."""
    dropout = getattr(critic, "dropout", None)
    if dropout is not None and critic.training and getattr(dropout, "p", 0.0) > 0:
        return None
    parts = plain_head(critic, getattr(critic, "score", None))
    return parts if parts is not None and can_share_prompts(critic) else None


def forward_values(critic: nn.Module, batch, share_prompts: bool = True) -> torch.Tensor:
    """Values of the response positions, differentiable (the critic update calls this).

    Args:
        critic: a model from :func:`load_critic`.
        batch: ``input_ids`` (B, P+T), ``attention_mask`` (B, P+T), ``responses`` (B, T),
            optionally ``position_ids``.
        share_prompts: run each distinct prompt of the batch once (see the module docstring);
            False always runs every row in full.

    Returns:
        (B, T) fp32 on the critic's device, 0 at padded response positions.
    """
    trimmed = trim_batch(batch, next(critic.parameters()).device)
    parts = value_head(critic) if share_prompts else None
    groups = prompt_groups(trimmed) if parts is not None else None
    if groups is not None:
        backbone, head = parts
        values = head(group_hidden(critic, backbone, trimmed, *groups))[..., 0].float()
    else:
        scores = critic(**trimmed.model_inputs(own_mask(critic))).logits  # (B, L', 1)
        values = scores[:, trimmed.start : trimmed.start + trimmed.kept, 0].float()
    return trimmed.to_full(values)


def compute_values(critic: nn.Module, batch, micro_batch_size: int) -> torch.Tensor:
    """Values of the response positions, without grad, in eval mode, micro-batched.

    Returns:
        (B, T) fp32 on the batch's device, 0 at padded response positions.
    """
    check_keys(batch)
    out_device = batch["responses"].device
    batch = on_device(batch, next(critic.parameters()).device)
    values = []
    with torch.no_grad(), eval_mode(critic):
        for piece in micro_batches(batch, micro_batch_size, MICRO_KEYS):
            values.append(forward_values(critic, piece))
    return torch.cat(values).to(out_device)
