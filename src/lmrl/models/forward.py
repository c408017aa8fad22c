"""Log-probs and entropy of the response tokens under a causal LM, memory-lean.

A batch holds ``input_ids = cat(prompts, responses)`` (B, P+T), left-padded prompts and
right-padded responses. The log-prob of response token ``t`` comes from the model's output at
position ``P - 1 + t``. Two choices keep this cheap:

- trimming: each micro-batch is cut to the columns where any row has a real token (the
  longest prompt's start to the longest response's end), so short micro-batches do not pay for
  the padding of the longest sequence in the whole batch. `lmrl.models.layout` does it, with the
  prompt groups and the attention masks, from what the host read of the rows once per update
  (`with_row_layout`), so that no micro-batch reads the device back;
- no logits: when the model ends in a plain ``nn.Linear`` output head (every Llama/Qwen/Mistral
  style model, LoRA or not), the backbone's hidden states go straight into
  :func:`lmrl.algos.logprob.log_probs_from_hidden`, so the (B, T, V) logits exist only one
  chunk of rows at a time, in forward and backward. Otherwise (a head with hooks or LoRA on it,
  logit scaling or soft-capping in the config) the model's own logits are used, only at the
  response positions, through the chunked :func:`~lmrl.algos.logprob.log_probs_from_logits`;
- shared prompts: GRPO's ``G`` samples of a prompt repeat the same prompt ``G`` times. When
  rows of a micro-batch share their prompt, the backbone runs each distinct prompt once, its
  key/value cache is gathered to every row (a differentiable ``index_select``: gradients from
  all ``G`` responses flow back into the one prompt pass), and only the response tokens run per
  row. A step's forward and backward then cost ``P + G * T`` tokens per group instead of
  ``G * (P + T)``; the maths is the same attention over the same keys (equal to the full
  forward up to float rounding). Used on the fused-head path, on models whose layers all attend
  to the full past; under gradient checkpointing for the tested model types on a CPU
  (`can_share_prompts`; `lmrl.models.prefix` makes the two passes' caches safe to replay).
  Where it pays (`lmrl.models.packing`: short packed rows, an sdpa model), each prompt and its
  responses go through the backbone as one packed row instead (one pass, no padding between
  responses); otherwise a prompt pass and a response pass (`shared_prompt_hidden`);
- the exact KL to a reference (`forward_log_probs_and_kl`, the actor's ``kl_loss_type=full``)
  takes the reference's hidden states for the same micro-batch (no grad) and fuses both heads
  into the same token chunks, so it adds no (B, T, V) tensor either.

Log-probs, entropy and KL at padded response positions are 0.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from peft import PeftModel
from torch import nn

from lmrl.algos.kl import full_kl_from_hidden
from lmrl.algos.logprob import full_kl_from_logits, log_probs_from_hidden, log_probs_from_logits
from lmrl.models.layout import (
    MICRO_KEYS,
    Trimmed,
    check_keys,
    micro_batches,
    on_device,
    prompt_groups,
    trim_batch,
)
from lmrl.models.packing import (
    LLAMA_FAMILY,
    pack_groups,
    packable,
    packed_hidden,
    packed_width,
    packs,
)
from lmrl.models.prefix import prefix_cache, prompt_cache, replayable, replayable_cache

# Config fields of models whose logits are not just ``lm_head(hidden)``.
LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "lm_head_multiplier",
)
# Prompts are shared under gradient checkpointing too (models of `LLAMA_FAMILY`), on the
# devices where that was measured to pay: a CPU (an update 3.9 s against 5.1 s,
# docs/performance.md). On CUDA the full pass of a micro-batch without padding attends with
# flash attention and the response pass with a mask; one H200 run of the 1.5B shape with
# sharing had a slower update than an earlier run without it (8.34 s against 6.30 s, other code
# changed too; docs/results/performance.md), and the A/B did not finish: not shared there yet.
CHECKPOINTED_SHARING_DEVICES = ("cpu",)


class ReferencePolicy(Protocol):
    """What `forward_log_probs_and_kl` needs of a reference (``lmrl.models.Reference`` is one):
    a context in which its model computes the reference policy."""

    def context(self) -> contextlib.AbstractContextManager[nn.Module]: ...


def compute_device(model: nn.Module) -> torch.device:
    """Where ``model`` computes: its parameters' device, or for FSDP2 shards kept on the CPU
    between uses (``CPUOffloadPolicy``), the device of their mesh."""
    param = next(model.parameters())
    mesh = getattr(param, "device_mesh", None)  # a DTensor's
    if mesh is None or mesh.device_type == param.device.type:
        return param.device
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def unwrap(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT wrapper (LoRA layers stay injected), else ``model``."""
    return model.get_base_model() if isinstance(model, PeftModel) else model


def cache_keyword(model: nn.Module) -> str:
    """The name under which ``model``'s forward takes a key/value cache: ``"cache"`` from the
    transformers releases that renamed it (5.2x; the old name warns there, and is to go in
    5.40), ``"past_key_values"`` before, and for a model whose forward names only that."""
    inner = unwrap(model)
    inner = getattr(inner, "_orig_mod", inner)  # torch.compile's wrapper
    return _cache_keyword_of(type(inner))


@functools.cache
def _cache_keyword_of(cls: type) -> str:
    """`cache_keyword` of a model class (read from its forward's signature once)."""
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def is_sharded(model: nn.Module) -> bool:
    """The model is FSDP2-sharded (``fully_shard``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(model, FSDPModule)


def plain_head(model: nn.Module, head: nn.Module | None) -> tuple[nn.Module, nn.Linear] | None:
    """``(model.base_model, head)`` when ``head`` is a plain, hook-free ``nn.Linear`` over the
    backbone of an unsharded transformers model, so that the head may be applied to hidden
    states the caller computed; None otherwise (the model's own forward must run)."""
    if is_sharded(model):  # the root's parameters are gathered by its own forward only
        return None
    backbone = getattr(model, "base_model", None)
    if type(head) is not nn.Linear or backbone is None or backbone is model:
        return None
    if head._forward_hooks or head._forward_pre_hooks:
        return None
    return backbone, head


def fused_head(model: nn.Module) -> tuple[nn.Module, nn.Linear] | None:
    """``(backbone, lm_head)`` when the model's logits are exactly ``lm_head(backbone(x))``
    (`plain_head`, no logit transform in the config); None when the logits path must be used."""
    inner = unwrap(model)
    parts = plain_head(inner, inner.get_output_embeddings())
    config = getattr(inner, "config", None)
    if parts is None or any(
        getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS
    ):
        return None
    return parts


def full_attention(model: nn.Module) -> bool:
    """Every layer of ``model`` attends to the full past (none to a sliding window)."""
    config = getattr(unwrap(model), "config", None)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    return all(t == "full_attention" for t in layer_types)


def own_mask(model: nn.Module) -> str | None:
    """How a micro-batch with a layout gives ``model`` its attention mask
    (`lmrl.models.layout.Trimmed.attention`): None, the 2-D mask, for transformers to build the
    rest from (not sdpa, not a tested type, or a sliding window's mask); else lmrl's 4-D boolean
    mask, which these models take as is (`packable`), and where no row is padded and no cache
    is given, ``"mapping"`` where the decoder takes the mapping of made masks (no mask at all)
    and ``"4d"`` where it does not (the causal mask)."""
    inner = unwrap(model)
    if not (packable(inner) and full_attention(inner)):
        return None
    return "mapping" if _takes_made_masks(type(getattr(inner, "base_model", inner))) else "4d"


@functools.cache
def _takes_made_masks(cls: type) -> bool:
    """``cls.forward`` (a transformers decoder) takes ``attention_mask`` as the mapping of masks
    already made per layer type: in transformers 5.2x Qwen2's and Qwen3's (their layers may use a
    sliding window), not Llama's or Mistral's."""
    try:
        return "causal_mask_mapping := attention_mask, dict" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def can_share_prompts(model: nn.Module) -> bool:
    """Whether `shared_prompt_hidden` applies: every layer attends to the full past (a
    sliding-window layer's cache keeps only the window, so a prompt longer than it would not
    match the full pass), and under gradient checkpointing the model is of `LLAMA_FAMILY`
    (whose checkpointed decoder layers are tested to keep `lmrl.models.prefix`'s caches), on a
    device of `CHECKPOINTED_SHARING_DEVICES`, with a transformers that lets them keep one."""
    config = getattr(unwrap(model), "config", None)
    if not full_attention(model):
        return False
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        return (
            getattr(config, "model_type", None) in LLAMA_FAMILY
            and compute_device(model).type in CHECKPOINTED_SHARING_DEVICES
            and replayable(model)
        )
    return True


def shared_prompt_hidden(
    backbone: nn.Module, trimmed: Trimmed, first: torch.Tensor, inverse: torch.Tensor
) -> torch.Tensor:
    """The hidden states that predict the response tokens, with each distinct prompt run once.

    Args:
        backbone: the decoder without its head (``fused_head(model)[0]``).
        trimmed: the micro-batch (B rows, ``start + 1`` prompt columns, ``kept`` responses).
        first, inverse: from `prompt_groups`.

    Returns:
        (B, kept, H): row ``b``'s hidden state at the positions that predict its response
        tokens ``0 .. kept-1`` (the last prompt position, then the responses but the last).
    """
    width = trimmed.start + 1
    keyword = cache_keyword(backbone)
    own = own_mask(backbone)
    with replayable_cache(backbone):
        cache = prompt_cache(backbone.config.num_hidden_layers)
        prompt = backbone(
            input_ids=trimmed.input_ids[first, :width],
            attention_mask=trimmed.attention(
                trimmed.attention_mask[first, :width], own, trimmed.prompt_dense
            ),
            position_ids=trimmed.position_ids[first, :width],
            use_cache=False,  # the cache passed is the one filled and read
            **{keyword: cache},
        )
        last = prompt.last_hidden_state[inverse, -1:]  # (B, 1, H)
        if trimmed.kept == 1:
            return last
        responses = backbone(
            input_ids=trimmed.input_ids[:, width : width + trimmed.kept - 1],
            attention_mask=trimmed.attention(
                trimmed.attention_mask[:, : width + trimmed.kept - 1], own, past=width
            ),
            position_ids=trimmed.position_ids[:, width : width + trimmed.kept - 1],
            use_cache=False,  # the cache passed is the one filled and read
            **{keyword: prefix_cache(cache, inverse)},  # (U, ...) -> (B, ...), differentiable
        )
    return torch.cat([last, responses.last_hidden_state], dim=1)


def group_hidden(
    model: nn.Module,
    backbone: nn.Module,
    trimmed: Trimmed,
    first: torch.Tensor,
    inverse: torch.Tensor,
) -> torch.Tensor:
    """`shared_prompt_hidden`'s (B, kept, H), from one packed pass where packing applies and
    pays (`lmrl.models.packing`: an sdpa model of a tested type, responses without holes,
    packed rows of at most ``MAX_PACKED`` tokens), else from the prompt pass and the response
    pass."""
    width = trimmed.start + 1
    valid = trimmed.response_valid[:, : trimmed.kept]
    lengths = valid.sum(1)
    if packable(unwrap(model)) and (total := _packed_width(trimmed, lengths, inverse, len(first))):
        packed = pack_groups(
            trimmed.input_ids, trimmed.position_ids, trimmed.attention_mask[:, :width],
            lengths, first, inverse, width, trimmed.kept, total,
        )  # fmt: skip
        return packed_hidden(backbone, packed)
    return shared_prompt_hidden(backbone, trimmed, first, inverse)


def _packed_width(
    trimmed: Trimmed, lengths: torch.Tensor, inverse: torch.Tensor, groups: int
) -> int | None:
    """The longest packed row's columns where packing applies (every response a prefix of its
    columns) and pays (`pack_pays`), else None; from the host's layout when there is one."""
    width, layout = trimmed.start + 1, trimmed.layout
    if layout is not None:
        if not layout.all_prefix:
            return None
        total = width + layout.packed_tokens()
    else:
        valid = trimmed.response_valid[:, : trimmed.kept]
        prefix = torch.arange(trimmed.kept, device=valid.device)[None, :] < lengths[:, None]
        if not torch.equal(valid, prefix):
            return None
        total = packed_width(width, lengths, inverse, groups)
    return total if packs(total) else None


def response_outputs(
    model: nn.Module, trimmed: Trimmed, share_prompts: bool = True
) -> tuple[torch.Tensor, nn.Linear | None]:
    """What scores the response tokens of a trimmed micro-batch, before any softmax.

    Returns:
        ``(hidden, lm_head)`` on the fused-head path: hidden (B, kept, H), the states that
        predict response tokens ``0 .. kept-1`` (each distinct prompt run once when
        ``share_prompts`` and the model allows it); else ``(logits, None)``: the model's own
        logits (B, K, V), K >= kept, whose first ``kept`` positions predict the response
        tokens (the others predict nothing scored).
    """
    head = fused_head(model)
    if head is not None:
        backbone, lm_head = head
        groups = None
        if share_prompts and can_share_prompts(model):
            groups = prompt_groups(trimmed)
        if groups is not None:
            hidden = group_hidden(model, backbone, trimmed, *groups)
        else:
            hidden = backbone(**trimmed.model_inputs(own_mask(backbone))).last_hidden_state
            hidden = hidden[:, trimmed.start : trimmed.start + trimmed.kept]
        return hidden, lm_head
    inner = unwrap(model)
    inputs = trimmed.model_inputs(own_mask(inner))
    keep = trimmed.input_ids.shape[1] - trimmed.start  # outputs from ``start`` to the end
    if "logits_to_keep" in inspect.signature(inner.forward).parameters:
        inputs["logits_to_keep"] = keep
    return inner(**inputs).logits[:, -keep:], None


def _score(
    trimmed: Trimmed,
    outputs: torch.Tensor,
    head: nn.Linear | None,
    temperature: float,
    with_entropy: bool,
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) log-probs (and entropy) of the response tokens from `response_outputs`."""
    if head is not None:
        log_probs, entropy = log_probs_from_hidden(
            outputs, head.weight, head.bias, trimmed.labels, temperature, with_entropy,
            chunk_size,
        )  # fmt: skip
    else:
        # The positions past ``kept`` predict nothing we score: dummy labels, dropped after.
        labels = F.pad(trimmed.labels, (0, outputs.shape[1] - trimmed.kept))
        log_probs, entropy = log_probs_from_logits(
            outputs, labels, temperature, with_entropy, chunk_size
        )
        log_probs = log_probs[:, : trimmed.kept]
        entropy = entropy[:, : trimmed.kept] if entropy is not None else None
    return trimmed.to_full(log_probs), (trimmed.to_full(entropy) if entropy is not None else None)


def forward_log_probs(
    model: nn.Module,
    batch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of ``batch["responses"]`` under ``model``, differentiable.

    The actor's update calls this per micro-batch with grad enabled; the model's train/eval mode
    is the caller's.

    Args:
        model: a causal LM (Hugging Face, or PEFT-wrapped).
        batch: ``input_ids`` (B, P+T), ``attention_mask`` (B, P+T), ``responses`` (B, T),
            optionally ``position_ids`` (B, P+T).
        temperature: the sampling temperature the logits are divided by.
        with_entropy: also return the per-token entropy of ``softmax(logits / temperature)``.
        chunk_size: rows per chunk in :mod:`lmrl.algos.logprob` (default ~64 MB of fp32).
        share_prompts: run each distinct prompt of the batch once (see the module docstring);
            False always runs every row in full.

    Returns:
        ``(log_probs, entropy)``: (B, T) fp32 on the model's device, 0 at padded response
        positions; ``entropy`` is None unless ``with_entropy``.
    """
    trimmed = trim_batch(batch, compute_device(model))
    outputs, head = response_outputs(model, trimmed, share_prompts)
    return _score(trimmed, outputs, head, temperature, with_entropy, chunk_size)


def forward_log_probs_and_kl(
    model: nn.Module,
    reference: ReferencePolicy,
    batch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`forward_log_probs`, plus the exact KL(pi || pi_ref) over the vocabulary per token.

    ``KL = sum_v pi(v) (log pi(v) - log ref(v))`` at each response position, both softmaxes of
    ``logits / temperature``. The reference runs first on the same trimmed micro-batch, without
    grad and in eval mode (a LoRA actor with its adapter disabled, or a frozen model); then the
    policy's forward with grad. When both end in a plain output head, the KL comes from the two
    hidden states through :func:`lmrl.algos.kl.full_kl_from_hidden`: logits exist one chunk of
    tokens at a time, as for the log-probs, and the extra memory is the reference's (B, T, H)
    hidden states. Otherwise both sides' logits at the response positions go through the
    chunked :func:`lmrl.algos.logprob.full_kl_from_logits`. The gradient flows through the
    policy only.

    Args:
        model: the policy, a causal LM (Hugging Face, or PEFT-wrapped).
        reference: the reference policy (``lmrl.models.Reference``), same vocabulary.
        batch, temperature, with_entropy, chunk_size, share_prompts: as in `forward_log_probs`.

    Returns:
        ``(log_probs, entropy, kl)``: (B, T) fp32 on the policy's device, 0 at padded
        response positions; ``entropy`` is None unless ``with_entropy``.
    """
    device = compute_device(model)
    trimmed = trim_batch(batch, device)
    with torch.no_grad(), reference.context() as ref_model, eval_mode(ref_model):
        ref_device = compute_device(ref_model)
        ref_trimmed = trimmed if ref_device == device else trim_batch(batch, ref_device)
        ref_outputs, ref_head = response_outputs(ref_model, ref_trimmed, share_prompts)
    ref_outputs = ref_outputs.to(device)
    outputs, head = response_outputs(model, trimmed, share_prompts)
    log_probs, entropy = _score(trimmed, outputs, head, temperature, with_entropy, chunk_size)
    if head is not None and ref_head is not None:
        kl = full_kl_from_hidden(
            outputs, head.weight, head.bias, ref_outputs, ref_head.weight.to(device),
            ref_head.bias.to(device) if ref_head.bias is not None else None, temperature,
            chunk_size,
        )  # fmt: skip
    else:
        logits = _response_logits(outputs, head, trimmed.kept, device)
        ref_logits = _response_logits(ref_outputs, ref_head, trimmed.kept, device)
        kl = full_kl_from_logits(logits, ref_logits, temperature, chunk_size)
    return log_probs, entropy, trimmed.to_full(kl)


def _response_logits(outputs, head, kept: int, device) -> torch.Tensor:
    """(B, kept, V) logits from `response_outputs`: through the head, or the first ``kept``."""
    if head is None:
        return outputs[:, :kept]
    bias = head.bias.to(device) if head.bias is not None else None
    return F.linear(outputs, head.weight.to(device), bias)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Run in eval mode (no dropout) and restore every module's own train/eval flag after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in flags:
            module.training = training


def compute_log_probs(
    model: nn.Module,
    batch,
    micro_batch_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    share_prompts: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the responses, without grad, in eval mode, micro-batched.

    Used for ``old_log_probs`` and ``ref_log_probs``. The result does not depend on
    ``micro_batch_size`` beyond floating-point rounding.

    Args:
        model: a causal LM (Hugging Face, or PEFT-wrapped).
        batch: a ``Batch`` with ``input_ids``, ``attention_mask``, ``responses`` and
            optionally ``position_ids``.
        micro_batch_size: rows per forward pass.
        temperature: the sampling temperature the logits are divided by.
        with_entropy: also return the per-token entropy.
        chunk_size: rows per chunk in :mod:`lmrl.algos.logprob`.
        share_prompts: as in `forward_log_probs`.

    Returns:
        ``(log_probs, entropy)``: (B, T) fp32 on the batch's device, 0 at padded response
        positions; ``entropy`` is None unless ``with_entropy``.
    """
    check_keys(batch)
    out_device = batch["responses"].device
    batch = on_device(batch, compute_device(model))
    log_probs, entropies = [], []
    with torch.no_grad(), eval_mode(model):
        for piece in micro_batches(batch, micro_batch_size, MICRO_KEYS):
            lp, ent = forward_log_probs(
                model, piece, temperature, with_entropy, chunk_size, share_prompts
            )
            log_probs.append(lp)
            if ent is not None:
                entropies.append(ent)
    entropy = torch.cat(entropies).to(out_device) if with_entropy else None
    return torch.cat(log_probs).to(out_device), entropy
