"""Group packing (`lmrl.models.packing`): a prompt and its responses in one row, kept apart by
the mask, against the unpacked shared-prompt forward and the full forward."""

from __future__ import annotations

import pytest
import torch

from lmrl.models import forward as forward_mod
from lmrl.models import forward_log_probs, load_causal_lm, packing
from lmrl.models.packing import pack_groups, pack_pays


def test_the_layout_keeps_each_response_to_its_prompt():
    """Two prompts of 3 columns (the second left-padded by one), rows in mixed order: each
    response follows its prompt with positions that continue the prompt's, sees the real prompt
    and itself only, and each row's hidden states are found where its tokens went."""
    # rows 0, 2 and 3 share prompt A = [11, 12, 13]; row 1 has prompt B = [pad, 21, 22]
    ids = torch.tensor(
        [
            [11, 12, 13, 31, 32, 0],  # response of 2 tokens (only the first is fed)
            [0, 21, 22, 41, 42, 43],  # 3 tokens
            [11, 12, 13, 51, 0, 0],  # 1 token: nothing fed
            [11, 12, 13, 61, 62, 63],  # 3 tokens
        ]
    )
    pos = torch.tensor(
        [[0, 1, 2, 3, 4, 5], [0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    )
    prompt_mask = torch.tensor([[True] * 3, [False, True, True], [True] * 3, [True] * 3])
    lengths = torch.tensor([2, 3, 1, 3])
    first, inverse = torch.tensor([0, 1]), torch.tensor([0, 1, 0, 0])
    packed = pack_groups(ids, pos, prompt_mask, lengths, first, inverse, width=3, kept=3)

    # group A: prompt, row 0's [31], row 2's nothing, row 3's [61, 62]; group B: prompt, [41, 42]
    assert packed.input_ids.tolist() == [[11, 12, 13, 31, 61, 62], [0, 21, 22, 41, 42, 0]]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 3, 4]  # each response from 3
    assert packed.position_ids[1, 1:5].tolist() == [0, 1, 2, 3]
    mask = packed.mask[:, 0].int()
    assert mask[0].tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],  # row 0's token: the prompt and itself
        [1, 1, 1, 0, 1, 0],  # row 3's first token: not row 0's
        [1, 1, 1, 0, 1, 1],
    ]
    assert mask[1].tolist() == [
        [1, 0, 0, 0, 0, 0],  # the left pad: itself only (a finite output nobody reads)
        [0, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 1, 1, 1, 0, 0],
        [0, 1, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # the tail pad: itself only
    ]
    # response token t of row b is predicted at (rows[b, t], cols[b, t]); padding at the prompt
    assert packed.rows.tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]]
    assert packed.cols.tolist() == [[2, 3, 2], [2, 3, 4], [2, 2, 2], [2, 4, 5]]


def test_packing_pays_up_to_the_longest_packed_row(monkeypatch):
    lengths, inverse = torch.tensor([5, 3, 7]), torch.tensor([0, 1, 0])
    assert pack_pays(10, lengths, inverse, 2)  # 10 + 4 + 6 = 20 tokens
    monkeypatch.setattr(packing, "MAX_PACKED", 20)
    assert pack_pays(10, lengths, inverse, 2)
    monkeypatch.setattr(packing, "MAX_PACKED", 19)
    assert not pack_pays(10, lengths, inverse, 2)


def _spy(monkeypatch) -> list[int]:
    """Count the packed passes `forward_log_probs` runs."""
    calls: list[int] = []
    real = forward_mod.packed_hidden

    def spy(backbone, packed):
        calls.append(packed.input_ids.shape[0])
        return real(backbone, packed)

    monkeypatch.setattr(forward_mod, "packed_hidden", spy)
    return calls


def _outputs(model, batch, temperature, **kwargs):
    mask = batch["response_mask"]
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2))
    logp, ent = forward_log_probs(model, batch, temperature, with_entropy=True, **kwargs)
    weights = weights.to(logp.device)
    ((logp * weights).sum() + 0.1 * (ent * weights).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logp.detach(), ent.detach(), grads


@pytest.mark.parametrize("arch", ["qwen", "llama"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_equals_the_unpacked_and_the_full_forward(
    arch, temperature, qwen_dir, llama_dir, grouped, monkeypatch
):
    """Log-probs, entropy and every gradient of the packed pass are the full forward's and the
    two-pass shared forward's, with the groups' rows shuffled (one row's response is empty)."""
    model = load_causal_lm(qwen_dir if arch == "qwen" else llama_dir).train()
    batch = grouped.index(torch.randperm(12, generator=torch.Generator().manual_seed(3)))
    calls = _spy(monkeypatch)
    packed = _outputs(model, batch, temperature)
    assert calls == [5]  # one pass: 5 distinct prompts, each with its responses
    full = _outputs(model, batch, temperature, share_prompts=False)
    monkeypatch.setattr(packing, "MAX_PACKED", 0)
    two_pass = _outputs(model, batch, temperature)
    assert calls == [5]
    mask = batch["response_mask"]
    for want in (full, two_pass):
        torch.testing.assert_close(packed[0], want[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(packed[1], want[1], atol=1e-5, rtol=0)
        for name, g in want[2].items():
            torch.testing.assert_close(packed[2][name], g, atol=1e-5, rtol=1e-5, msg=name)
    assert (packed[0][~mask] == 0).all()


def test_packing_is_left_out_where_it_does_not_apply(qwen_dir, grouped, monkeypatch):
    """An eager-attention model (it would add the boolean mask), a response mask with a hole
    (a packed response has none), a packed row past `MAX_PACKED`: the two-pass forward runs,
    with the full forward's log-probs."""
    calls = _spy(monkeypatch)
    model = load_causal_lm(qwen_dir)
    want, _ = forward_log_probs(model, grouped, 1.0, share_prompts=False)

    model.config._attn_implementation = "eager"
    got, _ = forward_log_probs(model, grouped, 1.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    model.config._attn_implementation = "sdpa"

    holed = grouped.index(torch.arange(12))  # a copy
    mask = holed["attention_mask"].clone()
    prompt_len = mask.shape[1] - holed["responses"].shape[1]
    mask[0, prompt_len + 1] = False  # row 0's second response token masked, its third kept
    holed["attention_mask"] = mask
    forward_log_probs(model, holed, 1.0)

    monkeypatch.setattr(packing, "MAX_PACKED", 8)
    got, _ = forward_log_probs(model, grouped, 1.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert calls == []
    monkeypatch.setattr(packing, "MAX_PACKED", 512)
    forward_log_probs(model, grouped, 1.0)
    assert calls == [5]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("autocast", [False, True])
def test_packed_equals_the_unpacked_on_cuda(autocast, qwen_dir, grouped, monkeypatch):
    """On CUDA (sdpa takes the boolean mask through its memory-efficient kernel), in fp32 and
    under bf16 autocast over fp32 weights: the packed pass gives the two-pass log-probs and
    gradients (bf16 to its rounding)."""
    model = load_causal_lm(qwen_dir).cuda().train()
    batch = grouped.index(torch.randperm(12, generator=torch.Generator().manual_seed(3)))
    batch = batch.to("cuda")
    calls = _spy(monkeypatch)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        packed = _outputs(model, batch, 1.0)
        monkeypatch.setattr(packing, "MAX_PACKED", 0)
        two_pass = _outputs(model, batch, 1.0)
    assert calls == [5]
    atol = 2e-2 if autocast else 1e-5
    torch.testing.assert_close(packed[0], two_pass[0], atol=atol, rtol=0)
    for name, g in two_pass[2].items():
        torch.testing.assert_close(packed[2][name], g, atol=atol, rtol=atol, msg=name)
