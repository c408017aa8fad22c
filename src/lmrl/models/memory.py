"""Bytes a decoder model holds, from its ``config.json`` alone (no weights are built).

The arithmetic behind ``lmrl plan`` (`lmrl.trainer.memory_plan`): parameter counts and the bytes
that the training step keeps alive per token, for the Qwen2 / Llama / Mistral decoder that
transformers builds (RMSNorm, rotary attention with grouped key/value heads through
``sdpa``, a gated SiLU MLP, an output head tied to the embedding or not).

Choices:

- counts come from the config fields (``hidden_size``, ``num_hidden_layers``,
  ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``,
  ``vocab_size``, ``tie_word_embeddings``, ``attention_bias`` / Qwen2's q/k/v biases,
  ``mlp_bias``), exactly as the modules are shaped: a test compares them with
  ``sum(p.numel())`` of the built models;
- activations are what autograd saves for the backward pass of one decoder layer, counted
  tensor by tensor from the transformers code (see `ModelShape.layer_activation_bytes`); the
  attention is ``sdpa``'s fused kernel (no (L, L) score matrix per head; its log-sum-exp is
  kept), the key/value heads repeated to the query heads when a padding mask is present
  (transformers' ``repeat_kv``); the (B, 1, L, L) bool mask is built once per forward and sdpa
  keeps its additive copy in the compute dtype in every layer (`ModelShape.mask_bytes`);
  a test compares the sum with what ``saved_tensors_hooks`` sees;
- with gradient checkpointing a layer keeps only its input, and the backward pass recomputes
  one layer at a time: the layer inputs of every layer plus one layer's full activations;
- the log-prob head is lmrl's fused, chunked one (`lmrl.algos.logprob.log_probs_from_hidden`):
  the logits exist ``2**24 // V`` rows at a time (``2**26 // V`` on CUDA; a few fp32 chunks
  live at once), and its backward accumulates the head's weight gradient in one fp32 (V, H)
  buffer.

Every figure is bytes; dtypes are given as their byte widths (4 for float32, 2 for bfloat16).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lmrl.algos.logprob import CHUNK_ELEMENTS

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2,
               "fp32": 4, "bf16": 2, "fp16": 2}  # fmt: skip
# the linear layers of a decoder layer that LoRA's ``all-linear`` adapts (peft leaves the
# output head alone)
LORA_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a config dtype name (``float32``, ``bfloat16``...)."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


def _field(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only causal LM that memory depends on.

    Build it with `ModelShape.from_config` from a transformers config or a ``config.json``
    dict. ``qkv_bias``: the q/k/v projections have biases (Qwen2); ``o_bias``: the output
    projection has one (Llama's ``attention_bias``); ``mlp_bias``: the MLP's three do.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """The shape of a Qwen2/Llama/Mistral-style config (object or ``config.json`` dict).

        Raises:
            ValueError: a config of another kind of model (a diffusers model's, one without a
                field the count needs), or a field of the wrong type (a size that is not a
                positive integer, ``"64"`` included; a flag that is not true or false); the
                message names the field and its value.
        """
        model_type = _field(config, "model_type", "")
        diffusers = _field(config, "_class_name")
        if diffusers is not None:
            raise ValueError(
                f"a diffusers {diffusers} config (_class_name), not a causal language model's: "
                "lmrl plan plans decoder-only LMs shaped like Qwen2/Llama"
            )
        missing = [
            name
            for name in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                         "intermediate_size", "vocab_size")
            if _field(config, name) is None
        ]  # fmt: skip
        if missing:
            raise ValueError(
                f"a {model_type or 'model'} config without {', '.join(missing)}: lmrl plan "
                "plans decoder-only causal LMs shaped like Qwen2/Llama"
            )

        def size(name: str, default: int | None = None) -> int:
            value = _field(config, name)
            if value is None and default is not None:  # an optional size left out
                return default
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                kind = " (a JSON number, not a string)" if isinstance(value, str) else ""
                raise ValueError(f"{name}={value!r} must be a positive integer{kind}")
            return value

        def flag(name: str) -> bool:
            value = _field(config, name, False)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be true or false")
            return bool(value)

        hidden = size("hidden_size")
        heads = size("num_attention_heads")
        kv_heads = size("num_key_value_heads", heads)
        head_dim = size("head_dim", hidden // heads or None)
        attention_bias = flag("attention_bias")
        qwen2 = model_type == "qwen2"
        return cls(
            hidden_size=hidden,
            num_layers=size("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=size("intermediate_size"),
            vocab_size=size("vocab_size"),
            tie_word_embeddings=flag("tie_word_embeddings"),
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias,
            mlp_bias=flag("mlp_bias"),
        )

    # -- parameters --------------------------------------------------------------------------

    def linear_shapes(self) -> dict[str, tuple[int, int, bool]]:
        """``name -> (in_features, out_features, has_bias)`` of one layer's linear modules."""
        h, q, kv, inter = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.intermediate_size,
        )
        return {
            "q_proj": (h, q, self.qkv_bias),
            "k_proj": (h, kv, self.qkv_bias),
            "v_proj": (h, kv, self.qkv_bias),
            "o_proj": (q, h, self.o_bias),
            "gate_proj": (h, inter, self.mlp_bias),
            "up_proj": (h, inter, self.mlp_bias),
            "down_proj": (inter, h, self.mlp_bias),
        }

    def layer_params(self) -> int:
        """Parameters of one decoder layer: attention, MLP and its two RMSNorms."""
        linear = sum(i * o + (o if b else 0) for i, o, b in self.linear_shapes().values())
        return linear + 2 * self.hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def head_params(self) -> int:
        """The output head's own parameters: 0 when tied to the embedding."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def num_params(self, value_head: bool = False) -> int:
        """All parameters of the causal LM; ``value_head``: a critic (the LM head replaced by
        a (H -> 1) ``score`` head, as `lmrl.models.critic` builds it)."""
        body = self.embedding_params() + self.num_layers * self.layer_params() + self.hidden_size
        if value_head:
            return body + self.hidden_size + 1  # score: weight and bias
        return body + self.head_params()

    def lora_params(self, rank: int, target_modules: str | Sequence[str] = "all-linear") -> int:
        """Trainable parameters of a LoRA adapter of ``rank``: ``rank * (in + out)`` for each
        adapted linear module of every layer (``all-linear``: the seven of `LORA_ALL_LINEAR`)."""
        if rank <= 0:
            return 0
        names = LORA_ALL_LINEAR if target_modules == "all-linear" else target_modules
        if isinstance(names, str):
            names = [names]
        shapes = self.linear_shapes()
        per_layer = sum(rank * (shapes[n][0] + shapes[n][1]) for n in names if n in shapes)
        return self.num_layers * per_layer

    # -- activations -------------------------------------------------------------------------

    def layer_activation_bytes(
        self, compute: int = 4, lora_rank: int = 0, stream: int | None = None
    ) -> int:
        """Bytes one decoder layer saves for backward, per token, computing in ``compute``
        bytes, without its input (`activation_bytes_per_token`) or the attention mask
        (`mask_bytes`).

        ``stream``: bytes of the residual stream, ``compute`` when the model's weights are
        in the compute dtype (fp32, pure bf16, FSDP2's cast parameters); 4 under autocast
        over fp32 weights, where the embedding and the residual sums stay fp32 and only the
        linear layers and attention compute in ``compute``.

        Counted from transformers' Qwen2/Llama layer: each RMSNorm keeps what `_norm_bytes`
        says; the attention keeps the rotated q, k and v repeated to every query head
        (transformers' ``repeat_kv`` under a padding mask), sdpa's output (which ``o_proj``
        reads: its (B, L, heads, d) layout makes the reshape a view) and fp32 log-sum-exp per
        head; the residual sum between attention and MLP when the stream is fp32 (below it the
        next norm keeps its own fp32 copy instead); the MLP keeps gate, SiLU(gate), up and
        their product. LoRA adds each adapted module's rank-``r`` output.
        """
        h, q, c = self.hidden_size, self.num_heads * self.head_dim, compute
        stream = c if stream is None else stream
        norm = self._norm_bytes(c, lora_rank > 0, stream)
        attention = 4 * q * c + self.num_heads * 4
        residual = h * stream if stream >= 4 else 0
        mlp = 4 * self.intermediate_size * c
        lora = 7 * lora_rank * c if lora_rank > 0 else 0
        return 2 * norm + attention + residual + mlp + lora

    def _norm_bytes(self, compute: int, frozen: bool, stream: int) -> int:
        """What one RMSNorm keeps per token: its fp32 ``rsqrt``; in an fp32 stream the
        normalized rows it hands its weight (not when the weight is frozen, as under LoRA),
        its output, and the linear layers' cast of it when they compute below fp32; in a
        bf16/fp16 stream its input's fp32 copy, the cast rows (unless frozen) and its output."""
        h, c = self.hidden_size, compute
        if stream >= 4:
            return (0 if frozen else h * stream) + h * stream + 4 + (h * c if c < stream else 0)
        return 4 * h + (1 if frozen else 2) * h * stream + 4

    def activation_bytes_per_token(
        self,
        compute: int = 4,
        checkpointing: bool = False,
        lora_rank: int = 0,
        stream: int | None = None,
    ) -> int:
        """Bytes the whole decoder saves per token for backward, at the peak of the pass
        (without the attention mask: `mask_bytes`); ``stream`` as in `layer_activation_bytes`.

        Without checkpointing: every layer's activations and, in an fp32 stream, its input
        (in a bf16 stream the norm keeps its own fp32 copy instead), plus the final norm's.
        With it: every layer's input (what non-reentrant checkpointing keeps) plus one
        layer's activations, recomputed one layer at a time in the backward pass.
        """
        h, c = self.hidden_size, compute
        stream = c if stream is None else stream
        layer = self.layer_activation_bytes(c, lora_rank, stream)
        final_norm = self._norm_bytes(c, lora_rank > 0, stream)
        final_norm += h * stream if stream >= 4 else 0
        if checkpointing:
            return self.num_layers * h * stream + layer + final_norm
        inputs = self.num_layers * h * stream if stream >= 4 else 0
        return inputs + self.num_layers * layer + final_norm

    def inference_bytes_per_token(self, compute: int = 4, stream: int | None = None) -> int:
        """Peak bytes per token of a forward without grad: nothing is kept for backward, so
        the residual stream and the largest transient of one layer (the MLP's gate, up and
        product, or the attention's q, k and v repeated, output) live at once; a bf16 stream
        adds the norm's fp32 copies, an fp32 stream under autocast the linears' cast input."""
        h, q, c = self.hidden_size, self.num_heads * self.head_dim, compute
        stream = c if stream is None else stream
        transient = max(3 * self.intermediate_size * c, 6 * q * c)
        extra = 8 * h if stream < 4 else (h * c if c < stream else 0)
        return 4 * h * stream + transient + extra

    def mask_bytes(
        self, micro_batch: int, length: int, compute: int = 4, layers: int | None = None
    ) -> int:
        """The attention mask of one micro-batch of ``length`` tokens: transformers builds one
        (B, 1, L, L) bool mask per forward, and sdpa converts it to an additive mask in the
        compute dtype in every layer, which the layer keeps for its backward (``layers`` of
        them; default all, one under checkpointing)."""
        layers = self.num_layers if layers is None else layers
        return micro_batch * length * length * (1 + layers * compute)

    def kv_cache_bytes_per_token(self, dtype: int) -> int:
        """Key and value of one token in every layer: ``layers x 2 x kv_heads x head_dim``."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype

    # -- the chunked log-prob head -----------------------------------------------------------

    def logprob_chunk_rows(self, tokens: int, device: str = "cpu") -> int:
        """Rows of one logits chunk in `lmrl.algos.logprob` by default on ``device``, at most
        ``tokens``."""
        elements = CHUNK_ELEMENTS
        try:
            from lmrl.algos.logprob import chunk_elements
        except ImportError:  # a lmrl whose chunks do not depend on the device
            pass
        else:
            elements = chunk_elements(device)
        return max(1, min(tokens, elements // max(self.vocab_size, 1)))

    def logprob_bytes(
        self,
        tokens: int,
        compute: int = 4,
        grad: bool = True,
        head_trains: bool = True,
        stream: int | None = None,
        master: int | None = None,
        device: str = "cpu",
    ) -> int:
        """Peak bytes of the fused log-prob head over ``tokens`` response rows, on top of the
        hidden states (counted by the caller).

        Forward: the (N, H) response rows copied out of the hidden states (in the ``stream``
        dtype, default ``compute``), and per chunk the fp32 logits, ``log p``, ``p`` and
        ``p log p`` (four (c, V) fp32 tensors, plus the compute-dtype matmul output when that
        is not fp32); the head weight cast to ``compute`` once when its ``master`` dtype is
        wider. Backward (``grad``): the (N, H) hidden gradient, the cast weight once more, the
        fp32 (V, H) weight-gradient buffer when the head trains with each chunk's fp32 (V, H)
        product before it is added (and the buffer's cast when the weights are not fp32), and
        per chunk the fp32 logits and ``p``. On CUDA half matmuls write fp32 directly.
        """
        rows = self.logprob_chunk_rows(tokens, device)
        v, h, c = self.vocab_size, self.hidden_size, compute
        master = c if master is None else master
        chunk = rows * v * 4
        per_token = 3 * 4  # lse, log-prob, entropy (fp32)
        response_rows = tokens * h * (c if stream is None else stream)
        cast_head = v * h * c if c < master else 0
        cuda = device == "cuda"  # half matmuls write fp32 there (``out_dtype``): no casts
        forward = response_rows + tokens * per_token + 4 * chunk + cast_head
        if c < 4 and not cuda:
            forward += rows * v * c
        if not grad:
            return forward
        # per chunk: the fp32 logits and p, then the gradient cast back (and on a CPU its
        # fp32 copy) beside the chunk's (V, H) weight-gradient product
        product = v * h * 4 if head_trains else 0
        cast_back = rows * v * (c if cuda else c + 4) if c < 4 else 0
        # the backward casts the weight once (for the logits and the head's gradients alike)
        backward = 2 * response_rows + tokens * per_token + cast_head
        backward += max(2 * chunk, cast_back + product)
        if head_trains:  # the fp32 buffer the products add into, and its last cast
            backward += v * h * 4 + (v * h * master if master < 4 else 0)
        return max(forward, backward)


def embedding_grad_bytes(shape: ModelShape, master: int) -> int:
    """Peak bytes of the embedding's backward at the end of a trained step, on top of the
    gradients: its dense (V, H) gradient; with a tied head also the head's gradient, which
    autograd holds until the embedding's arrives, and their sum (three (V, H) tensors)."""
    return (3 if shape.tie_word_embeddings else 1) * shape.vocab_size * shape.hidden_size * master


def parse_size(text: str) -> int:
    """Bytes of a size such as ``80GiB``, ``80GB``, ``512MiB`` or ``141e9B``: a positive
    number and its unit, always (a bare ``80`` would be 80 bytes, never what is meant).

    Raises:
        ValueError: not a positive number with one of the units B, KB, MB, GB, TB (powers of
            1000), KiB, MiB, GiB, TiB (powers of 1024); the message says so, and for a bare
            number, which unit to add.
    """
    units = {
        "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
        "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    }  # fmt: skip
    raw = str(text).strip()
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ").strip()
    unit = raw[len(number) :].strip().lower()
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if not unit and math.isfinite(value) and value > 0:
        raise ValueError(
            f"memory size {text!r} has no unit: give one, e.g. {number}GiB (2**30 bytes) or "
            f"{number}GB (10**9 bytes)"
        )
    if unit not in units or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"cannot read {text!r} as a memory size: give a positive number with a unit, "
            "e.g. 80GiB, 80GB or 512MiB (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return int(value * units[unit])


def format_bytes(n: float) -> str:
    """``n`` bytes as a short binary-unit string: ``1.50 GiB``, ``12.0 MiB``, ``512 B``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            value = n / size
            return f"{value:.2f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{int(n)} B"


class LiveTensorBytes:
    """Count the bytes of live tensor storages, and their peak, while it is active: a
    ``TorchDispatchMode`` that registers the storage of every op's output the first time it
    sees it and forgets it when the storage is freed (a weak-reference finalizer on the
    storage, whose Python object lives exactly as long as the storage does). Exact on any
    device, the CPU included, where no allocator statistics exist.

    Tensors alive before it starts are not seen unless passed to `track` (the model's
    parameters, their gradients and the optimizer's state, say).

    Example::

        with LiveTensorBytes() as live:
            live.track(*model.parameters())
            step()
        live.peak  # bytes
    """

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter._visit(out)
                return out

        self._mode = _Mode()
        self._seen: set[int] = set()
        self.current = 0
        self.peak = 0

    def _visit(self, out: Any) -> None:
        import torch
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)

    def track(self, *tensors: Any) -> None:
        """Count these tensors' storages (once each) until they are freed."""
        import weakref

        import torch

        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._seen or storage.nbytes() == 0:
                continue
            self._seen.add(key)
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key, storage.nbytes())

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.current -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.current

    def __enter__(self) -> LiveTensorBytes:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
