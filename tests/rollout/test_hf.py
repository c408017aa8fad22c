"""Tests of the ``hf`` engine on a tiny Qwen2 model built locally."""

from __future__ import annotations

import pytest
import torch

from lmrl.models import apply_lora, build_tiny_model, compute_log_probs, load_causal_lm
from lmrl.models.layout import distinct_rows
from lmrl.rollout import HFEngine, SamplingParams
from lmrl.rollout.sampling import Draws, _draw, _truncate

EOS, PAD = 258, 256
TEXTS = ["hello", "a", "what is 2+2?"]


def test_output_layout_shapes_and_dtypes(model, tokenizer, encode):
    prompts = encode(TEXTS, data_source=["d0", "d1", "d2"], extra_info=[{"i": i} for i in range(3)])
    prompts.meta["step"] = 3
    out = HFEngine(model, tokenizer).generate(
        prompts, n=2, sampling=SamplingParams(max_new_tokens=6, seed=0)
    )
    P, T = prompts["input_ids"].shape[1], out["responses"].shape[1]
    assert len(out) == 6 and 1 <= T <= 6
    expected = {
        "prompts": ((6, P), torch.long),
        "responses": ((6, T), torch.long),
        "input_ids": ((6, P + T), torch.long),
        "attention_mask": ((6, P + T), torch.bool),
        "position_ids": ((6, P + T), torch.long),
        "response_mask": ((6, T), torch.bool),
        "rollout_log_probs": ((6, T), torch.float32),
    }
    for key, (shape, dtype) in expected.items():
        assert tuple(out[key].shape) == shape and out[key].dtype == dtype, key
        assert not out[key].is_inference(), key  # usable by autograd later
    assert torch.equal(out["prompts"], prompts["input_ids"].repeat_interleave(2, dim=0))
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], dim=1))
    prompt_mask = prompts["attention_mask"].repeat_interleave(2, dim=0)
    assert torch.equal(out["attention_mask"], torch.cat([prompt_mask, out["response_mask"]], 1))
    # position_ids = cumsum(mask) - 1 clipped at 0: "a" (1 token, left-padded) starts at 0
    assert torch.equal(
        out["position_ids"], (out["attention_mask"].long().cumsum(1) - 1).clamp(min=0)
    )
    assert out["position_ids"][2, P - 1].item() == 0 and out["position_ids"][2, P].item() == 1
    assert out["data_source"].tolist() == ["d0", "d0", "d1", "d1", "d2", "d2"]
    assert out["extra_info"][3] == {"i": 1}
    uid = out["uid"].tolist()  # made per prompt: shared within a group, distinct across
    assert uid[0] == uid[1] and uid[2] == uid[3] and uid[4] == uid[5] and len(set(uid)) == 3
    assert out.meta == {"step": 3, "temperature": 1.0}
    lp, mask = out["rollout_log_probs"], out["response_mask"]
    assert (lp[~mask] == 0).all() and (lp[mask] < 0).all()
    assert (out["responses"][~mask] == PAD).all()


def test_masks_end_at_first_eos(model, tokenizer, encode, logit_bias):
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS] = 4.5  # EOS about one step in four
    with logit_bias(model, bias):
        out = HFEngine(model, tokenizer).generate(
            encode(TEXTS), n=4, sampling=SamplingParams(max_new_tokens=10, seed=1)
        )
    responses, mask = out["responses"], out["response_mask"]
    lengths = mask.sum(1)
    assert lengths.min() < lengths.max() and responses.shape[1] == lengths.max() <= 10
    ended_early = 0
    for row in range(len(out)):
        is_eos = (responses[row] == EOS) | (responses[row] == PAD)
        if is_eos.any():
            first = int(is_eos.nonzero()[0])
            assert mask[row].tolist() == [i <= first for i in range(responses.shape[1])]
            assert responses[row, first] == EOS  # the pad id is an EOS id too, never sampled here
            assert (responses[row, first + 1 :] == PAD).all()
            ended_early += 1
        else:  # no EOS: ran to max_new_tokens
            assert mask[row].all() and responses.shape[1] == 10
    assert ended_early > 0


def test_ignore_eos_runs_every_sample_to_max_new_tokens(model, tokenizer, encode, logit_bias):
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS] = 4.5  # EOS about one step in four: without ignore_eos samples end early
    with logit_bias(model, bias):
        out = HFEngine(model, tokenizer).generate(
            encode(TEXTS), n=4, sampling=SamplingParams(max_new_tokens=10, seed=1, ignore_eos=True)
        )
    assert out["responses"].shape == (12, 10) and out["response_mask"].all()
    assert (out["responses"] == EOS).any()  # EOS was sampled and kept as a token
    assert (out["rollout_log_probs"] < 0).all()


def test_max_new_tokens_cuts_without_eos(model, tokenizer, encode):
    out = HFEngine(model, tokenizer, eos_token_ids=[10_000]).generate(
        encode(TEXTS), sampling=SamplingParams(max_new_tokens=3, seed=0)
    )
    assert out["responses"].shape == (3, 3) and out["response_mask"].all()


def test_stop_strings(model, tokenizer, encode, logit_bias):
    bias = torch.full((model.config.vocab_size,), -1e4)
    bias[ord("a") : ord("z") + 1] = 0.0  # letters only: one character per token
    engine = HFEngine(model, tokenizer)
    prompts = encode([*TEXTS, "xyz"])
    with logit_bias(model, bias):
        free = engine.generate(prompts, sampling=SamplingParams(max_new_tokens=24, seed=3))
        texts = tokenizer.batch_decode(free["responses"])
        stop = texts[0][6:8]
        stopped = engine.generate(
            prompts, sampling=SamplingParams(max_new_tokens=24, seed=3, stop=[stop, "#"])
        )
    for row, text in enumerate(texts):
        at = text.find(stop)
        length = at + len(stop) if at >= 0 else 24
        assert stopped["response_mask"][row].sum().item() == length, (row, text, stop)
        kept = stopped["responses"][row, :length]
        assert torch.equal(kept, free["responses"][row, :length])  # same draws until the stop
        if at >= 0:
            assert tokenizer.decode(kept).endswith(stop)
    assert stopped["response_mask"][0].sum() <= 8


def test_n_samples_grouped_by_uid(model, tokenizer, encode):
    prompts = encode(TEXTS[:2], uid=["p0", "p1"])
    out = HFEngine(model, tokenizer).generate(
        prompts, n=3, sampling=SamplingParams(max_new_tokens=8, seed=0)
    )
    assert out["uid"].tolist() == ["p0", "p0", "p0", "p1", "p1", "p1"]
    for g in range(2):
        rows = out["prompts"][3 * g : 3 * g + 3]
        assert (rows == prompts["input_ids"][g]).all()
        samples = {tuple(r) for r in out["responses"][3 * g : 3 * g + 3].tolist()}
        assert len(samples) == 3  # sampled, so the group's samples differ


def test_greedy_is_deterministic_and_argmax(model, tokenizer, encode):
    engine = HFEngine(model, tokenizer)
    greedy = SamplingParams(do_sample=False, temperature=0, max_new_tokens=8)
    a = engine.generate(encode(TEXTS), n=2, sampling=greedy)
    b = engine.generate(encode(TEXTS), n=2, sampling=greedy)
    assert torch.equal(a["responses"], b["responses"])
    assert torch.equal(a["responses"][0::2], a["responses"][1::2])  # both samples the same
    # the first token is the argmax of a plain forward pass
    ids, mask = encode(TEXTS)["input_ids"], encode(TEXTS)["attention_mask"]
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits[:, -1]
    assert torch.equal(a["responses"][0::2, 0], logits.argmax(-1))
    # top_k=1 and a tiny top_p both leave only the argmax
    for sampling in (
        SamplingParams(top_k=1, max_new_tokens=8),
        SamplingParams(top_p=1e-6, max_new_tokens=8),
    ):
        c = engine.generate(encode(TEXTS), n=2, sampling=sampling)
        assert torch.equal(c["responses"], a["responses"])


def test_seeds_reproduce_and_global_rng_untouched(model, tokenizer, encode):
    engine = HFEngine(model, tokenizer)
    rng = torch.get_rng_state()

    def sample(seed):
        params = SamplingParams(max_new_tokens=8, seed=seed, top_p=0.9, top_k=50)
        return engine.generate(encode(TEXTS), n=2, sampling=params)["responses"]

    assert torch.equal(sample(7), sample(7))
    assert not torch.equal(sample(7), sample(8))
    # without a seed the engine's own generator moves on from call to call
    own = HFEngine(model, tokenizer, seed=5)
    first = own.generate(encode(TEXTS), sampling=SamplingParams(max_new_tokens=8))["responses"]
    second = own.generate(encode(TEXTS), sampling=SamplingParams(max_new_tokens=8))["responses"]
    again = HFEngine(model, tokenizer, seed=5).generate(
        encode(TEXTS), sampling=SamplingParams(max_new_tokens=8)
    )
    assert not torch.equal(first, second) and torch.equal(first, again["responses"])
    assert torch.equal(torch.get_rng_state(), rng)


def test_rollout_log_probs_equal_a_full_forward(model, tokenizer, encode):
    """Naive reference: log_softmax(logits / temperature) of one full forward, gathered."""
    sampling = SamplingParams(temperature=0.7, top_p=0.8, top_k=40, max_new_tokens=8, seed=2)
    out = HFEngine(model, tokenizer).generate(encode(TEXTS), n=2, sampling=sampling)
    P = out["prompts"].shape[1]
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"],
            attention_mask=out["attention_mask"].long(),
            position_ids=out["position_ids"],
        ).logits[:, P - 1 : -1]
    ref = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, out["responses"][..., None])[
        ..., 0
    ]
    mask = out["response_mask"]
    torch.testing.assert_close(out["rollout_log_probs"][mask], ref[mask], atol=1e-4, rtol=0)
    assert out.meta["temperature"] == 0.7


@pytest.mark.parametrize("lora", [False, True])
def test_rollout_log_probs_equal_compute_log_probs(model, tokenizer, encode, lora):
    if lora:  # a PEFT-wrapped actor with a non-zero adapter
        model = apply_lora(model, lora_rank=4)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    sampling = SamplingParams(temperature=0.7, top_k=30, max_new_tokens=8, seed=4)
    out = HFEngine(model, tokenizer).generate(encode(TEXTS), n=2, sampling=sampling)
    log_probs, _ = compute_log_probs(model, out, micro_batch_size=4, temperature=0.7)
    mask = out["response_mask"]
    assert log_probs.shape == mask.shape
    torch.testing.assert_close(out["rollout_log_probs"][mask], log_probs[mask], atol=1e-4, rtol=0)
    assert (out["rollout_log_probs"][~mask] == 0).all()


def test_left_padding_gives_the_prompt_alone_continuation(model, tokenizer, encode):
    engine = HFEngine(model, tokenizer)
    greedy = SamplingParams(do_sample=False, max_new_tokens=10)
    together = engine.generate(encode(TEXTS), sampling=greedy)
    for row, text in enumerate(TEXTS):
        alone = engine.generate(encode([text]), sampling=greedy)
        length = alone["response_mask"][0].sum()
        assert together["response_mask"][row].sum() == length
        assert torch.equal(together["responses"][row, :length], alone["responses"][0, :length])


def test_micro_batches_and_given_position_ids_change_nothing(model, tokenizer, encode):
    greedy = SamplingParams(do_sample=False, max_new_tokens=6)
    prompts = encode(TEXTS)
    full = HFEngine(model, tokenizer).generate(prompts, n=2, sampling=greedy)
    pieces = HFEngine(model, tokenizer, micro_batch_size=4).generate(prompts, n=2, sampling=greedy)
    prompts["position_ids"] = (prompts["attention_mask"].long().cumsum(1) - 1).clamp(min=0)
    with_pos = HFEngine(model, tokenizer).generate(prompts, n=2, sampling=greedy)
    for other in (pieces, with_pos):
        for key in ("responses", "response_mask", "position_ids", "attention_mask"):
            assert torch.equal(other[key], full[key]), key
        torch.testing.assert_close(other["rollout_log_probs"], full["rollout_log_probs"])


def test_shared_prefill_equals_per_row_prefill(model, tokenizer, encode):
    """The n samples of a prompt prefill it once; the rollout is that of n separate prefills."""
    engine = HFEngine(model.eval(), tokenizer)
    prompts = encode(TEXTS)
    rows = torch.arange(3).repeat_interleave(4)
    first, inverse = distinct_rows(rows)
    assert torch.equal(first, torch.tensor([0, 4, 8])) and torch.equal(inverse, rows)
    ids, mask = prompts["input_ids"][rows], prompts["attention_mask"][rows]
    sampling = SamplingParams(max_new_tokens=8, seed=3)
    outs = []
    with torch.inference_mode():
        for groups in ((first, inverse), (None, None)):
            draws = Draws(3, torch.arange(len(rows)))
            outs.append(engine._sample(ids, mask, None, sampling, draws, *groups))
    (responses, response_mask, log_probs), (ref_responses, ref_mask, ref_log_probs) = outs
    assert torch.equal(responses, ref_responses) and torch.equal(response_mask, ref_mask)
    torch.testing.assert_close(log_probs, ref_log_probs, atol=1e-5, rtol=0)


def test_train_flags_restored(model, tokenizer, encode):
    model.train()
    model.model.layers[0].eval()  # a mixed state must come back as it was
    flags = [m.training for m in model.modules()]
    HFEngine(model, tokenizer).generate(
        encode(TEXTS[:1]), sampling=SamplingParams(max_new_tokens=2)
    )
    assert [m.training for m in model.modules()] == flags


def test_sync_weights_loads_the_actor(model, tokenizer, encode, tiny_dir, tmp_path):
    other = load_causal_lm(build_tiny_model(tmp_path, seed=1)).eval()
    greedy = SamplingParams(do_sample=False, max_new_tokens=8)
    engine = HFEngine(other, tokenizer)
    reference = HFEngine(model, tokenizer).generate(encode(TEXTS), sampling=greedy)
    assert not torch.equal(
        engine.generate(encode(TEXTS), sampling=greedy)["responses"], reference["responses"]
    )
    engine.sync_weights(model.state_dict())
    assert torch.equal(
        engine.generate(encode(TEXTS), sampling=greedy)["responses"], reference["responses"]
    )


def test_truncate_by_hand():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])  # softmax ~ [0.644, 0.237, 0.087, 0.032]
    inf = float("-inf")
    assert _truncate(logits, top_k=2, top_p=1.0).tolist() == [[3.0, 2.0, inf, inf]]
    assert _truncate(logits, top_k=-1, top_p=0.5).tolist() == [[3.0, inf, inf, inf]]
    assert _truncate(logits, top_k=0, top_p=0.7).tolist() == [[3.0, 2.0, inf, inf]]
    assert _truncate(logits, top_k=3, top_p=0.95).tolist() == [[3.0, 2.0, 1.0, inf]]
    assert _truncate(logits, top_k=10, top_p=1.0).tolist() == logits.tolist()


def test_draw_samples_the_distribution_and_never_a_zero():
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.5, 0.4, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 2.0]])
    rows = probs.repeat(50_000, 1)  # unnormalized rows are fine
    u = Draws(0, torch.arange(len(rows))).uniform(0)
    tokens = _draw(rows, u).view(50_000, 2)
    freq = torch.stack([torch.bincount(tokens[:, i], minlength=6) for i in range(2)]) / 50_000
    torch.testing.assert_close(freq, probs / probs.sum(1, keepdim=True), atol=0.01, rtol=0)
    assert (freq[probs == 0] == 0).all()
    assert torch.equal(
        tokens, _draw(rows, Draws(0, torch.arange(len(rows))).uniform(0)).view(50_000, 2)
    )
    # u at the edges: 0 takes the first token of positive mass, just below 1 the last
    edge = torch.tensor([[0.0], [1.0 - 2.0**-53]], dtype=torch.float64)
    assert _draw(probs, edge).tolist() == [1, 5]


@pytest.mark.parametrize("block", [4, 7, 1024])
def test_the_two_level_draw_is_the_full_inversion(monkeypatch, block):
    """Blocks of 4 or 7 (a short last block) over 30 tokens, some blocks all zeros: the block,
    then the token inside it, are the token the full float64 cumulative sum gives."""
    from lmrl.rollout import sampling

    monkeypatch.setattr(sampling, "DRAW_BLOCK", block)
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(20_000, 30, generator=gen) * (torch.rand(20_000, 30, generator=gen) > 0.5)
    probs[:, 4:12] = 0.0  # whole blocks of nothing
    probs[:, 0] += 1e-3  # every row has mass
    u = Draws(9, torch.arange(len(probs))).uniform(0)
    cdf = probs.double().cumsum(dim=-1)
    want = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    got = _draw(probs, u)
    assert torch.equal(got, want)
    assert (probs.gather(1, got[:, None]) > 0).all()
    edge = torch.tensor([[0.0], [1.0 - 2.0**-53]], dtype=torch.float64)
    last = torch.tensor([[0.0] * 29 + [1.0], [1.0] + [0.0] * 29])
    assert _draw(last, edge).tolist() == [29, 0]


def test_counter_based_uniforms_are_uniform_and_independent():
    """100k draws over rows and steps: moments and a 20-bin chi-square of a uniform, and no
    correlation between neighbouring rows or steps (what a weak hash would leave)."""
    draws = Draws(12345, torch.arange(10_000))
    u = torch.cat([draws.uniform(t) for t in range(10)], dim=1)  # (rows, steps)
    flat = u.flatten()
    assert ((flat >= 0) & (flat < 1)).all()
    assert abs(float(flat.mean()) - 0.5) < 0.005 and abs(float(flat.var()) - 1 / 12) < 0.002
    counts = torch.histc(flat.float(), bins=20, min=0, max=1)
    expected = len(flat) / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 43.8  # the 0.999 quantile of chi-square with 19 degrees of freedom
    for a, b in ((u[:-1], u[1:]), (u[:, :-1], u[:, 1:])):
        r = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(float(r)) < 0.02
    # another seed, another stream; the same seed, the same
    assert not torch.equal(Draws(12346, torch.arange(10)).uniform(0), draws.uniform(0)[:10])
    assert torch.equal(Draws(12345, torch.arange(10)).uniform(3), draws.uniform(3)[:10])


def test_split_calls_and_micro_batches_sample_what_one_call_samples(model, tokenizer, encode):
    sampling = SamplingParams(max_new_tokens=8, seed=11, top_k=50)
    prompts = encode(TEXTS)
    whole = HFEngine(model, tokenizer).generate(prompts, n=3, sampling=sampling)
    head = HFEngine(model, tokenizer).generate(prompts.index(slice(0, 1)), n=3, sampling=sampling)
    tail = HFEngine(model, tokenizer, micro_batch_size=2).generate(
        prompts.index(slice(1, None)), n=3, sampling=sampling, prompt_offset=1
    )
    for key in ("responses", "response_mask", "rollout_log_probs"):
        width = min(head[key].shape[1], tail[key].shape[1], whole[key].shape[1])
        joined = torch.cat([head[key][:, :width], tail[key][:, :width]])
        if key == "rollout_log_probs":
            torch.testing.assert_close(joined, whole[key][:, :width], atol=1e-5, rtol=0)
        else:
            assert torch.equal(joined, whole[key][:, :width]), key
    moved = HFEngine(model, tokenizer).generate(
        prompts.index(slice(1, None)), n=3, sampling=sampling
    )  # the same prompts at another position draw differently
    assert not torch.equal(moved["responses"], tail["responses"])


def test_no_seed_key_or_step_draws_a_degenerate_uniform():
    """The avalanche hash maps 0 to 0; seed 0, row 0, step 0 once drew u = 2**-53 (the
    first token of the first sample was always the lowest id with any probability)."""
    for seed in (0, 1 << 32, 2**64 - 1):
        u = torch.cat([Draws(seed, torch.arange(4096)).uniform(t) for t in range(4)], dim=1)
        assert u.min() > 1e-6 and u.max() < 1 - 1e-6


def test_on_a_cpu_the_engine_applies_a_plain_head_itself(model, tokenizer, encode):
    """On a CPU the engine runs the backbone and then the plain head (``W @ h.T``) itself: the
    logits of the model's own forward; a hook on the model's forward makes it run the model's
    forward instead, so the hook sees every step."""
    from transformers import DynamicCache

    prompts = encode(TEXTS)
    ids, mask = prompts["input_ids"], prompts["attention_mask"].long()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    engine = HFEngine(model, tokenizer)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
    heads = []
    model.lm_head.forward = lambda h, real=model.lm_head.forward: heads.append(1) or real(h)
    try:
        with torch.no_grad():
            got = engine._forward(ids, mask, pos, DynamicCache(config=model.config))
            assert heads == []  # the head's weight, not its forward
            hooked = []
            handle = model.register_forward_pre_hook(lambda *args: hooked.append(1))
            try:
                again = engine._forward(ids, mask, pos, DynamicCache(config=model.config))
            finally:
                handle.remove()
    finally:
        del model.lm_head.forward
    assert hooked == [1] and heads == [1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(again, want, atol=1e-5, rtol=0)
