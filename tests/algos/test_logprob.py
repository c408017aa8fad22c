"""Chunked log-prob, entropy and full KL against naive float64 autograd references."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lmrl.algos.logprob import full_kl_from_logits, log_probs_from_hidden, log_probs_from_logits

B, T, V, H = 3, 5, 11, 4  # 15 rows: chunk sizes 4 and 7 do not divide it


def naive_log_probs(logits, labels, temperature):
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def naive_kl(logits, ref_logits, temperature):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    logq = torch.log_softmax(ref_logits.double() / temperature, dim=-1)
    # kl_div(input=log q, target=log p, log_target) = sum p (log p - log q)
    return torch.nn.functional.kl_div(logq, logp, reduction="none", log_target=True).sum(-1)


def grads(outputs, inputs, weights):
    """Gradients of sum(w_i * out_i) wrt inputs (random weights test every row's gradient)."""
    total = sum((w * o.double()).sum() for o, w in zip(outputs, weights, strict=True))
    return torch.autograd.grad(total, inputs)


def make(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, T, V, generator=g)).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    w_logp = torch.randn(B, T, generator=g, dtype=torch.float64)
    w_ent = torch.randn(B, T, generator=g, dtype=torch.float64)
    return logits, labels, w_logp, w_ent


def test_hand_worked_uniform_logits():
    # Uniform logits over V: log p = -log V and H = log V whatever the temperature.
    logits = torch.zeros(1, 2, 4)
    logp, ent = log_probs_from_logits(logits, torch.tensor([[0, 3]]), 0.7, with_entropy=True)
    assert torch.allclose(logp, torch.full((1, 2), -math.log(4)))
    assert torch.allclose(ent, torch.full((1, 2), math.log(4)))
    # Two tokens with logits (0, log 3): p = (1/4, 3/4); log p[1] = log 0.75.
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    logp, _ = log_probs_from_logits(logits, torch.tensor([[1]]))
    assert logp.item() == pytest.approx(math.log(0.75), abs=1e-7)
    assert full_kl_from_logits(logits, logits).abs().max() < 1e-7


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [4, 7, None])
def test_log_probs_from_logits_matches_naive(temperature, chunk_size):
    logits, labels, w_logp, w_ent = make()
    x = logits.clone().requires_grad_(True)
    logp, ent = log_probs_from_logits(x, labels, temperature, True, chunk_size)
    assert logp.shape == ent.shape == (B, T) and logp.dtype == ent.dtype == torch.float32
    ref = logits.double().requires_grad_(True)
    ref_logp, ref_ent = naive_log_probs(ref, labels, temperature)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    (g,) = grads([logp, ent], [x], [w_logp, w_ent])
    (g_ref,) = grads([ref_logp, ref_ent], [ref], [w_logp, w_ent])
    assert g.dtype == torch.float32
    torch.testing.assert_close(g.double(), g_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_gradient_of_logp_only_and_entropy_only(temperature):
    logits, labels, w_logp, w_ent = make(seed=1)
    ref = logits.double().requires_grad_(True)
    ref_logp, _ = naive_log_probs(ref, labels, temperature)
    x = logits.clone().requires_grad_(True)
    logp, ent = log_probs_from_logits(x, labels, temperature, with_entropy=False, chunk_size=4)
    assert ent is None
    (g,) = grads([logp], [x], [w_logp])
    (g_ref,) = grads([ref_logp], [ref], [w_logp])
    torch.testing.assert_close(g.double(), g_ref, atol=1e-5, rtol=0)
    x = logits.clone().requires_grad_(True)
    _, ent = log_probs_from_logits(x, labels, temperature, with_entropy=True, chunk_size=4)
    (g,) = grads([ent], [x], [w_ent])
    _, ref_ent = naive_log_probs(ref, labels, temperature)
    (g_ref,) = grads([ref_ent], [ref], [w_ent])
    torch.testing.assert_close(g.double(), g_ref, atol=1e-5, rtol=0)


def test_log_probs_accepts_bf16_and_keeps_its_dtype_for_the_gradient():
    logits, labels, w_logp, w_ent = make(torch.bfloat16, seed=2)
    x = logits.clone().requires_grad_(True)
    logp, ent = log_probs_from_logits(x, labels, 0.7, with_entropy=True, chunk_size=4)
    ref = logits.double().requires_grad_(True)  # the same bf16 values, exactly
    ref_logp, ref_ent = naive_log_probs(ref, labels, 0.7)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    (g,) = grads([logp, ent], [x], [w_logp, w_ent])
    (g_ref,) = grads([ref_logp, ref_ent], [ref], [w_logp, w_ent])
    assert g.dtype == torch.bfloat16
    # The only error left is bf16's rounding of the gradient itself (8 bits of mantissa).
    torch.testing.assert_close(g.double(), g_ref, atol=1e-5, rtol=2**-8)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_log_probs_from_hidden_matches_naive(temperature, with_bias):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    bias = torch.randn(V, generator=g) if with_bias else None
    labels = torch.randint(0, V, (B, T), generator=g)
    w_logp = torch.randn(B, T, generator=g, dtype=torch.float64)
    w_ent = torch.randn(B, T, generator=g, dtype=torch.float64)

    inputs = [t.clone().requires_grad_(True) for t in (hidden, weight, bias) if t is not None]
    b = inputs[2] if with_bias else None
    logp, ent = log_probs_from_hidden(inputs[0], inputs[1], b, labels, temperature, True, 4)
    refs = [t.double().requires_grad_(True) for t in (hidden, weight, bias) if t is not None]
    logits = refs[0] @ refs[1].t() + (refs[2] if with_bias else 0)
    ref_logp, ref_ent = naive_log_probs(logits, labels, temperature)
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    got = grads([logp, ent], inputs, [w_logp, w_ent])
    want = grads([ref_logp, ref_ent], refs, [w_logp, w_ent])
    for x, y in zip(got, want, strict=True):
        assert x.dtype == torch.float32
        torch.testing.assert_close(x.double(), y, atol=1e-5, rtol=0)


class CountMatmuls(TorchDispatchMode):
    """Counts the aten matmuls run inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_one_chunk_keeps_its_logits_for_the_backward():
    """When one chunk holds every row, the backward takes the forward's logits (two head
    matmuls instead of three) with the gradients of recomputing them chunk by chunk; a second
    backward of a retained graph computes them again, with the same gradients."""
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    results = []
    for chunk in (None, 4):  # one chunk of 15 rows, or four
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        logp, ent = log_probs_from_hidden(h, w, None, labels, 0.7, True, chunk)
        loss = logp.sum() + 0.5 * ent.sum()
        counter = CountMatmuls()
        with counter:
            first = torch.autograd.grad(loss, [h, w], retain_graph=True)
        again = torch.autograd.grad(loss, [h, w])
        results.append((first, counter.count))
        for x, y in zip(first, again, strict=True):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
    (kept, kept_mm), (chunked, chunked_mm) = results
    assert kept_mm == 2 and chunked_mm == 3 * 4
    for x, y in zip(kept, chunked, strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)


def test_log_probs_from_hidden_skips_frozen_weight_and_equals_logits_path():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 7, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g)  # frozen, as an lm_head under LoRA
    labels = torch.randint(0, V, (2, 7), generator=g)
    logp, _ = log_probs_from_hidden(hidden, weight, None, labels, chunk_size=3)
    logp_l, _ = log_probs_from_logits(hidden @ weight.t(), labels)
    torch.testing.assert_close(logp, logp_l, atol=1e-6, rtol=0)
    (gh,) = torch.autograd.grad(logp.sum(), [hidden])
    (gh_l,) = torch.autograd.grad(logp_l.sum(), [hidden])
    torch.testing.assert_close(gh, gh_l, atol=1e-6, rtol=0)
    assert weight.grad is None


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [4, None])
def test_full_kl_matches_kl_div(temperature, chunk_size):
    logits, _, w, _ = make(seed=5)
    ref_logits = logits + torch.randn(B, T, V, generator=torch.Generator().manual_seed(6))
    x = logits.clone().requires_grad_(True)
    kl = full_kl_from_logits(x, ref_logits, temperature, chunk_size)
    assert kl.shape == (B, T) and kl.dtype == torch.float32 and (kl >= 0).all()
    ref = logits.double().requires_grad_(True)
    ref_kl = naive_kl(ref, ref_logits, temperature)
    torch.testing.assert_close(kl.double(), ref_kl, atol=1e-5, rtol=0)
    (g,) = grads([kl], [x], [w])
    (g_ref,) = grads([ref_kl], [ref], [w])
    torch.testing.assert_close(g.double(), g_ref, atol=1e-5, rtol=0)


def test_full_kl_bf16_and_no_gradient_to_reference():
    logits, _, w, _ = make(torch.bfloat16, seed=7)
    ref_logits = (logits.float() + 0.5).to(torch.bfloat16).requires_grad_(True)
    x = logits.clone().requires_grad_(True)
    kl = full_kl_from_logits(x, ref_logits, 0.7, chunk_size=7)
    ref_kl = naive_kl(logits.double(), ref_logits.detach().double(), 0.7)
    torch.testing.assert_close(kl.double(), ref_kl, atol=1e-5, rtol=0)
    (w * kl).sum().backward()
    assert x.grad.dtype == torch.bfloat16 and ref_logits.grad is None


def test_inputs_are_left_unchanged():
    logits, labels, _, _ = make()
    x = logits.clone().requires_grad_(True)
    logp, ent = log_probs_from_logits(x, labels, 1.0, True, 4)
    (logp.sum() + ent.sum()).backward()
    kl = full_kl_from_logits(x, logits * 2, 1.0, 4)
    kl.sum().backward()
    assert torch.equal(x.detach(), logits)


def test_bad_input_names_the_argument():
    logits, labels, _, _ = make()
    with pytest.raises(ValueError, match="labels"):
        log_probs_from_logits(logits, labels[:, :2])
    with pytest.raises(ValueError, match="labels"):
        log_probs_from_logits(logits, labels.float())
    with pytest.raises(ValueError, match="temperature"):
        log_probs_from_logits(logits, labels, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        log_probs_from_logits(logits, labels, chunk_size=0)
    with pytest.raises(ValueError, match="ref_logits"):
        full_kl_from_logits(logits, logits[:, :2])
    with pytest.raises(ValueError, match="weight"):
        log_probs_from_hidden(torch.randn(B, T, H), torch.randn(V, H + 1), None, labels)
    with pytest.raises(ValueError, match="bias"):
        log_probs_from_hidden(torch.randn(B, T, H), torch.randn(V, H), torch.randn(V + 1), labels)


class LargestFloat32Output(TorchDispatchMode):
    """Records the largest number of elements of any fp32 tensor an aten op outputs."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("fn", ["hidden", "logits", "kl"])
def test_no_fp32_rows_by_vocab_tensor_in_forward_or_backward(fn):
    """Only one chunk (8 of 64 rows) of fp32 (rows, V) values ever exists; the logits path's
    one full-size tensor is its gradient, in the logits' own dtype (bf16 here)."""
    vocab, width, chunk = 1000, 4, 8
    g = torch.Generator().manual_seed(8)
    labels = torch.randint(0, vocab, (4, 16), generator=g)
    hidden = torch.randn(4, 16, width, generator=g, requires_grad=True)
    weight = torch.randn(vocab, width, generator=g, requires_grad=True)
    logits = torch.randn(4, 16, vocab, generator=g).to(torch.bfloat16).requires_grad_(True)
    mode = LargestFloat32Output()
    with mode:
        if fn == "hidden":
            logp, ent = log_probs_from_hidden(hidden, weight, None, labels, 0.7, True, chunk)
            (logp.sum() + ent.sum()).backward()
        elif fn == "logits":
            logp, ent = log_probs_from_logits(logits, labels, 0.7, True, chunk)
            (logp.sum() + ent.sum()).backward()
        else:
            full_kl_from_logits(logits, logits.detach() * 0.5, 0.7, chunk).sum().backward()
    # One chunk of fp32 logits, or the (V, H) fp32 weight gradient, whichever is larger.
    assert mode.largest == max(chunk * vocab, vocab * width if fn == "hidden" else 0)
    assert logits.grad is None or logits.grad.dtype == torch.bfloat16


def test_under_autocast_the_fused_head_computes_as_the_lm_head_does():
    """Mixed precision: fp32 master weights under bf16 autocast. The fused head's matmuls run
    in bf16 (as ``lm_head`` under autocast would), the log-probs in fp32, and the gradients come
    back in the masters' dtype, equal to autograd through the autocast head."""
    from lmrl.algos.logprob import head_dtype

    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    labels = torch.randint(0, 40, (2, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert head_dtype(hidden, weight) == torch.bfloat16
        logp, _ = log_probs_from_hidden(hidden, weight, None, labels, chunk_size=3)
        logits = hidden @ weight.t()  # autocast: bf16
    assert logits.dtype == torch.bfloat16 and logp.dtype == torch.float32
    naive = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(logp, naive, rtol=0, atol=1e-6)  # the same bf16 logits
    (g_h, g_w) = torch.autograd.grad(logp.sum(), (hidden, weight))
    (n_h, n_w) = torch.autograd.grad(naive.sum(), (hidden, weight))
    assert g_w.dtype == torch.float32 and g_h.dtype == torch.float32
    # bf16 matmuls on both sides; ours accumulates the chunks' weight gradient in fp32
    torch.testing.assert_close(g_h, n_h, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(g_w, n_w, rtol=2e-2, atol=2e-2)
    assert head_dtype(hidden, weight) == torch.float32  # autocast off: the dtypes' promotion


def test_a_gpu_chunk_is_larger_than_a_cpu_chunk():
    from lmrl.algos.logprob import _rows_per_chunk, chunk_elements

    assert chunk_elements("cuda") == 4 * chunk_elements("cpu") == 2**26
    assert _rows_per_chunk(151_936, None, torch.device("cuda")) == 441
    assert _rows_per_chunk(151_936, None, torch.device("cpu")) == 110
    assert _rows_per_chunk(151_936, 7, torch.device("cuda")) == 7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_fused_head_on_cuda_accumulates_in_fp32():
    """On CUDA a bf16 head multiplies on the tensor cores with fp32 outputs: the log-probs and
    gradients match an fp32 computation from the same bf16 values closely, the weight
    gradient summed over many chunks in fp32."""
    torch.manual_seed(0)
    hidden = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (0.05 * torch.randn(32000, 256, device="cuda")).bfloat16().requires_grad_()
    labels = torch.randint(0, 32000, (4096,), device="cuda")
    logp, _ = log_probs_from_hidden(hidden, weight, None, labels, chunk_size=256)
    g_h, g_w = torch.autograd.grad(logp.sum(), (hidden, weight))
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref = torch.log_softmax(h32 @ w32.t(), -1).gather(-1, labels[:, None])[:, 0]
    r_h, r_w = torch.autograd.grad(ref.sum(), (h32, w32))
    assert logp.dtype == torch.float32 and g_w.dtype == torch.bfloat16
    torch.testing.assert_close(logp, ref, rtol=0, atol=2e-3)
    torch.testing.assert_close(g_h.float(), r_h, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(g_w.float(), r_w, rtol=2e-2, atol=2e-3)
