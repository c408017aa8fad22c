"""Models: loading policy, reference and critic from a path, LoRA, and response log-probs.

Everything goes through Hugging Face ``Auto*`` classes, so a tiny model built by
:mod:`lmrl.models.tiny` and a user's ``/path/to/Qwen2.5-0.5B-Instruct`` take the same path.
Log-probs use the chunked maths of :mod:`lmrl.algos.logprob`: no (B, T, V) fp32 tensor is built.
"""

from lmrl.models.critic import compute_values, forward_values, load_critic
from lmrl.models.forward import compute_log_probs, forward_log_probs
from lmrl.models.layout import trim_batch
from lmrl.models.loading import (
    ModelPathError,
    enable_gradient_checkpointing,
    freeze,
    load_causal_lm,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    set_pad_token,
)
from lmrl.models.lora import apply_lora, export_merged, is_lora, load_lora, merge_lora, save_lora
from lmrl.models.reference import Reference, build_reference
from lmrl.models.tiny import build_tiny_model, build_tiny_reward_model, build_tokenizer

__all__ = [
    "ModelPathError",
    "Reference",
    "apply_lora",
    "build_reference",
    "build_tiny_model",
    "build_tiny_reward_model",
    "build_tokenizer",
    "compute_log_probs",
    "compute_values",
    "enable_gradient_checkpointing",
    "export_merged",
    "forward_log_probs",
    "forward_values",
    "freeze",
    "is_lora",
    "load_causal_lm",
    "load_critic",
    "load_lora",
    "load_tokenizer",
    "merge_lora",
    "resolve_device",
    "resolve_dtype",
    "save_lora",
    "set_pad_token",
    "trim_batch",
]
