"""Token log-probabilities, entropy and exact KL from logits, in row chunks.

With a Qwen-sized vocabulary (V = 151,936) the logits of one micro-batch are the largest tensor
of a training step: B=8, T=1024 in fp32 is 5 GB, and the naive ``log_softmax(logits.float())``
builds two or three more of those (the fp32 copy, the log-softmax, its gradient). The functions
here never build any of them. Each is a custom ``torch.autograd.Function`` that walks the rows
(tokens) in chunks of ``chunk_size``, upcasts one chunk at a time to fp32, keeps only per-row
statistics (log-sum-exp, entropy, KL) for the backward pass, and in backward recomputes the
softmax of each chunk and writes its gradient into one preallocated tensor of the input's dtype.

:func:`log_probs_from_hidden` goes one step further and fuses the output projection: the logits
``hidden @ weight.T + bias`` exist one chunk at a time, in forward and backward, so a policy's
log-probs cost memory proportional to the hidden size, not to the vocabulary.

The gradients, with ``z = logits / temperature`` and ``p = softmax(z)`` (per row):

    d log p[y] / dz = onehot(y) - p
    d H / dz        = -p * (log p + H)           where H = -sum p log p  (z - E_p[z] = log p + H)
    d KL / dz       = p * (log p - log q - KL)   where KL = sum p (log p - log q)

and ``d / dlogits = (d / dz) / temperature``. The maths runs in fp32 (fp64 for fp64 inputs) and
returns fp32 results whatever the dtype of the logits (bf16, fp16, fp32); gradients come back in
the inputs' dtypes. None of the functions is differentiable twice.
"""

from __future__ import annotations

import torch

# Elements (rows x V) of one fp32 chunk: 2**24 is 64 MB, ~110 rows of a Qwen vocabulary. Much
# smaller chunks re-read the (V, H) head weight too often. On a GPU 2**26 (256 MB, ~440 rows):
# the head's matmuls then fill the tensor cores and a micro-batch is a few launches, not dozens.
CHUNK_ELEMENTS = 2**24
CUDA_CHUNK_ELEMENTS = 2**26
_HALF = (torch.float16, torch.bfloat16)
_MM_OUT_DTYPE = [True]  # torch.mm(..., out_dtype=float32) works for half inputs here (CUDA)


def _acc(t: torch.Tensor) -> torch.dtype:
    """The dtype the maths runs in: fp32 for half/bf16/fp32 inputs, fp64 for fp64."""
    return torch.promote_types(t.dtype, torch.float32)


def chunk_elements(device: torch.device | str | None = None) -> int:
    """Elements of one fp32 chunk of logits by default on ``device``."""
    cuda = device is not None and torch.device(device).type == "cuda"
    return CUDA_CHUNK_ELEMENTS if cuda else CHUNK_ELEMENTS


def _rows_per_chunk(
    vocab_size: int, chunk_size: int | None, device: torch.device | None = None
) -> int:
    if chunk_size is None:
        return max(1, chunk_elements(device) // max(vocab_size, 1))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
    return chunk_size


def _check_temperature(temperature: float) -> float:
    temperature = float(temperature)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return temperature


def _check_labels(labels: torch.Tensor, lead_shape: torch.Size, name: str = "logits") -> None:
    if not isinstance(labels, torch.Tensor) or labels.shape != lead_shape:
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(
            f"labels must have shape {tuple(lead_shape)} (the {name}' leading dims), got {shape}"
        )
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")


def _row_stats(z: torch.Tensor, labels: torch.Tensor, with_entropy: bool):
    """Log-sum-exp, label log-prob and (optionally) entropy of fp32 rows ``z`` (c, V).

    The entropy is ``-sum p log p`` over ``log p = z - lse``, not ``lse - E_p[z]``: that
    difference of two large numbers loses digits in fp32 when the logits are large.
    """
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, labels[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return lse, logp, None
    log_p = z - lse[:, None]
    entropy = -(log_p.exp() * log_p).sum(-1)
    return lse, logp, entropy


def _grad_z(z, labels, lse, entropy, grad_logp, grad_entropy, temperature):
    """Gradient wrt the logits of one fp32 chunk ``z`` (already divided by the temperature).

    ``z`` is overwritten. Returns (c, V) fp32:
    ``(g_logp * (onehot - p) - g_H * p * (log p + H)) / T``, as ``z - E_p[z] = log p + H``.
    """
    log_p = z.sub_(lse[:, None])
    p = log_p.exp()
    if grad_entropy is not None:
        g = log_p.add_(entropy[:, None]).mul_(p).mul_(-grad_entropy[:, None])
        if grad_logp is not None:
            g.addcmul_(p, grad_logp[:, None], value=-1.0)
    else:
        g = p.mul_(-grad_logp[:, None])
    if grad_logp is not None:
        g.scatter_add_(1, labels[:, None], grad_logp[:, None])
    if temperature != 1.0:
        g.div_(temperature)
    return g


class _LogProbsFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, with_entropy, rows):
        n = logits.shape[0]
        lse = logits.new_empty(n, dtype=_acc(logits))
        logp = logits.new_empty(n, dtype=_acc(logits))
        entropy = logits.new_empty(n if with_entropy else 0, dtype=_acc(logits))
        for i in range(0, n, rows):
            j = min(i + rows, n)
            z = logits[i:j].to(_acc(logits))
            if temperature != 1.0:
                z = z / temperature
            lse[i:j], logp[i:j], h = _row_stats(z, labels[i:j], with_entropy)
            if with_entropy:
                entropy[i:j] = h
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.temperature, ctx.rows = temperature, rows
        ctx.set_materialize_grads(False)  # an unused output's gradient comes as None: skipped
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        logits, labels, lse, entropy = ctx.saved_tensors
        if entropy.numel() == 0:
            grad_entropy = None
        n, temperature, rows = logits.shape[0], ctx.temperature, ctx.rows
        grad = torch.empty_like(logits)
        for i in range(0, n, rows):
            j = min(i + rows, n)
            z = logits[i:j].to(_acc(logits), copy=True)  # _grad_z overwrites it
            if temperature != 1.0:
                z.div_(temperature)
            g = _grad_z(
                z,
                labels[i:j],
                lse[i:j],
                entropy[i:j] if grad_entropy is not None else None,
                grad_logp[i:j] if grad_logp is not None else None,
                grad_entropy[i:j] if grad_entropy is not None else None,
                temperature,
            )
            grad[i:j] = g
        return grad, None, None, None, None


def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of ``labels`` under ``softmax(logits / temperature)``, and its entropy.

    Equal to ``log_softmax(logits.float() / T).gather(-1, labels)`` and
    ``-(p * log p).sum(-1)``, without materializing a (B, T, V) fp32 tensor in forward or
    backward: rows are processed ``chunk_size`` at a time, and the gradient is written into one
    tensor of the logits' dtype.

    Args:
        logits: (B, T, V) (any leading dims), any float dtype (bf16 is fine).
        labels: (B, T) integer token ids in [0, V).
        temperature: the sampling temperature, > 0.
        with_entropy: also return the entropy of each row's distribution.
        chunk_size: rows per chunk; default keeps one fp32 chunk near 64 MB.

    Returns:
        ``(log_probs, entropy)``: (B, T) fp32 each, ``entropy`` None unless ``with_entropy``.
        Both are differentiable wrt ``logits``.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 2:
        raise ValueError("logits must be a (..., V) tensor")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    _check_labels(labels, logits.shape[:-1])
    temperature = _check_temperature(temperature)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    rows = _rows_per_chunk(vocab, chunk_size, logits.device)
    logp, entropy = _LogProbsFromLogits.apply(
        logits.reshape(-1, vocab), labels.reshape(-1).long(), temperature, with_entropy, rows
    )
    return logp.view(lead), (entropy.view(lead) if with_entropy else None)


class _LogProbsFromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, with_entropy, rows):
        n = hidden.shape[0]
        dtype = head_dtype(hidden, weight)
        acc = torch.promote_types(dtype, torch.float32)
        lse = hidden.new_empty(n, dtype=acc)
        logp = hidden.new_empty(n, dtype=acc)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=acc)
        w = weight.to(dtype)  # one cast of a master head, not one per chunk
        with torch.autocast(hidden.device.type, enabled=False):
            for i in range(0, n, rows):
                j = min(i + rows, n)
                z = _chunk_logits(hidden[i:j], w, bias, temperature, dtype)
                lse[i:j], logp[i:j], h = _row_stats(z, labels[i:j], with_entropy)
                if with_entropy:
                    entropy[i:j] = h
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.temperature, ctx.rows, ctx.has_bias = temperature, rows, bias is not None
        ctx.dtype = dtype
        # One chunk holds every row: its logits wait for the backward instead of being computed
        # again (a quarter of the head's matmuls), still one chunk of memory. An intermediate
        # held by ctx, not saved: the backward overwrites it and lets it go.
        ctx.kept = z if n <= rows and any(ctx.needs_input_grad[:3]) else None
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        if entropy.numel() == 0:
            grad_entropy = None
        temperature, dtype = ctx.temperature, ctx.dtype
        w = weight.to(dtype)

        def grad_z(i: int, j: int) -> torch.Tensor:
            z, ctx.kept = ctx.kept, None  # a second backward (retain_graph) recomputes
            if z is None:
                z = _chunk_logits(hidden[i:j], w, bias, temperature, dtype)
            return _grad_z(
                z,
                labels[i:j],
                lse[i:j],
                entropy[i:j] if grad_entropy is not None else None,
                grad_logp[i:j] if grad_logp is not None else None,
                grad_entropy[i:j] if grad_entropy is not None else None,
                temperature,
            )

        grads = _head_backward(hidden, weight, bias, ctx.needs_input_grad[:3], ctx.rows, grad_z,
                               cast=w)  # fmt: skip
        return (*grads, None, None, None, None)


def head_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype a fused head's matmuls run in: autocast's where it is on (mixed precision:
    bf16 compute over fp32 master weights, as the model's own ``lm_head`` would run), else the
    promotion of the two dtypes."""
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _mm_acc(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with its sum accumulated and returned in fp32 (fp64 for fp64): half inputs
    on CUDA take the tensor cores with an fp32 output (``torch.mm(..., out_dtype=)``),
    elsewhere both are upcast first (exact, and what a CPU can do)."""
    if a.dtype in _HALF and a.is_cuda and _MM_OUT_DTYPE[0]:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # a torch without the fp32-output matmul
            _MM_OUT_DTYPE[0] = False
    acc = _acc(a)
    return a.to(acc) @ b.to(acc)


def _head_backward(hidden, weight, bias, needs, rows, grad_z, cast=None):
    """Gradients of ``hidden``, ``weight`` and ``bias`` of a linear head, chunk by chunk.

    Args:
        hidden: (N, H); weight: (V, H); bias: (V,) or None.
        needs: ``ctx.needs_input_grad`` of the three.
        rows: rows per chunk.
        grad_z: ``grad_z(i, j)`` -> fp32 (j - i, V): d loss / d logits of rows ``i:j``.
        cast: ``weight`` in the dtype the head computed in (`head_dtype`), as the caller's
            ``grad_z`` uses it; None = ``weight`` itself.
    Returns:
        ``(grad_hidden, grad_weight, grad_bias)``, None where not needed. The weight and bias
        gradients are summed over all chunks in fp32 and cast once at the end.
    """
    need_h, need_w, need_b = needs
    w = weight if cast is None else cast
    dtype = w.dtype
    acc = torch.promote_types(weight.dtype, torch.float32)
    grad_h = torch.empty_like(hidden) if need_h else None
    grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
    grad_b = torch.zeros_like(bias, dtype=acc) if need_b and bias is not None else None
    for i in range(0, hidden.shape[0], rows):
        j = min(i + rows, hidden.shape[0])
        g = grad_z(i, j)
        if grad_b is not None:
            grad_b += g.sum(0)
        g = g.to(dtype)  # as autograd would cast it back through ``.float()``
        if need_h:
            grad_h[i:j] = g @ w
        if need_w:
            grad_w += _mm_acc(g.t(), hidden[i:j].to(dtype))
    return (
        grad_h,
        grad_w.to(weight.dtype) if need_w else None,
        grad_b.to(bias.dtype) if grad_b is not None else None,
    )


def _chunk_logits(h, weight, bias, temperature, dtype=None):
    """fp32 logits / temperature of one chunk of hidden states: (c, H) -> (c, V), the matmul in
    ``dtype`` (None: the promotion of ``h``'s and ``weight``'s) with fp32 accumulation."""
    if dtype is not None:
        h, weight = h.to(dtype), weight.to(dtype)
    if h.is_cuda:
        z = _mm_acc(h, weight.t())
    else:  # as the model's lm_head computes them on a CPU: in its dtype, then upcast
        z = h @ weight.t()
        z = z.to(_acc(z))
    if bias is not None:
        z += bias.to(z.dtype)
    if temperature != 1.0:
        z /= temperature
    return z


def log_probs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused output projection and log-prob: :func:`log_probs_from_logits` of
    ``hidden @ weight.T + bias`` without ever holding more than one chunk of logits.

    The projection runs in the dtype of ``hidden``/``weight`` (as the model's ``lm_head`` would)
    and each chunk of logits is upcast to fp32. Gradients flow to ``hidden``, ``weight`` and
    ``bias`` (only those that require grad are computed; the weight gradient is accumulated in
    fp32 over the chunks).

    Args:
        hidden: (B, T, H) (any leading dims) final hidden states.
        weight: (V, H) output projection (the ``lm_head`` weight).
        bias: (V,) or None.
        labels: (B, T) integer token ids in [0, V).
        temperature: the sampling temperature, > 0.
        with_entropy: also return the entropy of each row's distribution.
        chunk_size: rows per chunk; default keeps one fp32 chunk of logits near 64 MB.

    Returns:
        ``(log_probs, entropy)``: (B, T) fp32 each, ``entropy`` None unless ``with_entropy``.
    """
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        raise ValueError("hidden must be a (..., H) tensor")
    if (
        not isinstance(weight, torch.Tensor)
        or weight.dim() != 2
        or weight.shape[1] != hidden.shape[-1]
    ):
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be (V, H) with H = {hidden.shape[-1]}, got {shape}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    _check_labels(labels, hidden.shape[:-1], name="hidden")
    temperature = _check_temperature(temperature)
    lead, width = hidden.shape[:-1], hidden.shape[-1]
    rows = _rows_per_chunk(weight.shape[0], chunk_size, weight.device)
    logp, entropy = _LogProbsFromHidden.apply(
        hidden.reshape(-1, width), weight, bias, labels.reshape(-1).long(), temperature,
        with_entropy, rows,
    )  # fmt: skip
    return logp.view(lead), (entropy.view(lead) if with_entropy else None)


class _FullKLFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ref_logits, temperature, rows):
        n = logits.shape[0]
        lse = logits.new_empty(n, dtype=_acc(logits))
        ref_lse = logits.new_empty(n, dtype=_acc(logits))
        kl = logits.new_empty(n, dtype=_acc(logits))
        for i in range(0, n, rows):
            j = min(i + rows, n)
            logp, lse[i:j] = _log_softmax_chunk(logits[i:j], temperature)
            logq, ref_lse[i:j] = _log_softmax_chunk(ref_logits[i:j], temperature)
            kl[i:j] = (logp.exp() * (logp - logq)).sum(-1)
        ctx.save_for_backward(logits, ref_logits, lse, ref_lse, kl)
        ctx.temperature, ctx.rows = temperature, rows
        return kl

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_kl):
        logits, ref_logits, lse, ref_lse, kl = ctx.saved_tensors
        n, temperature, rows = logits.shape[0], ctx.temperature, ctx.rows
        grad = torch.empty_like(logits)
        for i in range(0, n, rows):
            j = min(i + rows, n)
            logp = _log_softmax_chunk(logits[i:j], temperature, lse[i:j])
            logq = _log_softmax_chunk(ref_logits[i:j], temperature, ref_lse[i:j])
            # p * (log p - log q - KL) * g / T, built in logq's storage.
            g = logq.neg_().add_(logp).sub_(kl[i:j, None]).mul_(logp.exp_())
            g.mul_(grad_kl[i:j, None] / temperature)
            grad[i:j] = g
        return grad, None, None, None


def _log_softmax_chunk(x, temperature, lse=None):
    """fp32 log-softmax of one chunk of logits / temperature, in a fresh tensor; also returns
    the log-sum-exp when ``lse`` is not given."""
    z = x.to(_acc(x), copy=True)
    if temperature != 1.0:
        z.div_(temperature)
    if lse is not None:
        return z.sub_(lse[:, None])
    lse = torch.logsumexp(z, dim=-1)
    return z.sub_(lse[:, None]), lse


def full_kl_from_logits(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Exact KL(pi || pi_ref) per token from full logits, in row chunks.

    ``KL = sum_v p_v (log p_v - log q_v)`` with ``p = softmax(logits / T)`` and
    ``q = softmax(ref_logits / T)``; no (B, T, V) fp32 tensor is built in forward or backward.

    Args:
        logits: (B, T, V) policy logits (any leading dims), any float dtype.
        ref_logits: (B, T, V) reference logits; treated as a constant (no gradient).
        temperature: the sampling temperature, > 0, applied to both.
        chunk_size: rows per chunk; default keeps one fp32 chunk near 64 MB.

    Returns:
        (B, T) fp32 KL, >= 0, differentiable wrt ``logits``.
    """
    for name, t in (("logits", logits), ("ref_logits", ref_logits)):
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating point (..., V) tensor")
    if ref_logits.shape != logits.shape:
        raise ValueError(
            f"ref_logits has shape {tuple(ref_logits.shape)} but logits has shape "
            f"{tuple(logits.shape)}; they must match"
        )
    temperature = _check_temperature(temperature)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    rows = _rows_per_chunk(vocab, chunk_size, logits.device)
    kl = _FullKLFromLogits.apply(
        logits.reshape(-1, vocab), ref_logits.detach().reshape(-1, vocab), temperature, rows
    )
    return kl.view(lead)
