"""The ``hf`` engine's static-cache decode (`lmrl.rollout.static`) against today's loop.

On the CPU the static path runs eagerly: it must give the same tokens and masks as the
``DynamicCache`` loop, and log-probs equal up to float32 reduction order (atol 1e-5: the static
attention sums over the whole preallocated width, masked columns adding exact zeros). On CUDA
(tests marked ``gpu``) the CUDA-graph replay must give the tokens of the eager static path.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from lmrl.models import apply_lora
from lmrl.rollout import HFEngine, SamplingParams
from lmrl.rollout import static as static_mod
from lmrl.rollout.static import resolve_decode, static_supported

EOS = 258
TEXTS = ["hello", "a", "what is 2+2?"]
ATOL = 1e-5


def _both(model, tokenizer, prompts, n, sampling, *, modes=("dynamic", "static"), **kw):
    return [
        HFEngine(model, tokenizer, decode=mode, **kw).generate(prompts, n=n, sampling=sampling)
        for mode in modes
    ]


def _same(a, b, atol=ATOL):
    assert torch.equal(a["responses"], b["responses"])
    assert torch.equal(a["response_mask"], b["response_mask"])
    torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], atol=atol, rtol=0)


@pytest.mark.parametrize("check_every", [1, 3, 16])
def test_static_equals_dynamic_with_eos(model, tokenizer, encode, logit_bias, check_every):
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS] = 4.5  # EOS about one step in four: rows end apart
    sampling = SamplingParams(max_new_tokens=12, seed=1)
    with logit_bias(model, bias):
        dyn, sta = _both(model, tokenizer, encode(TEXTS), 4, sampling, check_every=check_every)
    lengths = dyn["response_mask"].sum(1)
    assert lengths.min() < lengths.max()  # the case is not trivial
    _same(dyn, sta)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_new_tokens=9, seed=2, ignore_eos=True),
        SamplingParams(max_new_tokens=9, seed=3, temperature=0.7, top_k=30, top_p=0.9),
        SamplingParams(max_new_tokens=9, do_sample=False),
        SamplingParams(max_new_tokens=1, seed=4),
        SamplingParams(max_new_tokens=2, seed=5),
    ],
    ids=["ignore_eos", "truncated", "greedy", "one_token", "two_tokens"],
)
def test_static_equals_dynamic(model, tokenizer, encode, logit_bias, sampling):
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS] = 3.0
    with logit_bias(model, bias):
        dyn, sta = _both(model, tokenizer, encode(TEXTS), 3, sampling)
    _same(dyn, sta)
    if sampling.ignore_eos:
        assert sta["response_mask"].all() and (sta["responses"] == EOS).any()


def test_static_equals_dynamic_with_stop_strings(model, tokenizer, encode, logit_bias):
    bias = torch.full((model.config.vocab_size,), -1e4)
    bias[ord("a") : ord("z") + 1] = 0.0  # letters only: one character per token
    prompts = encode([*TEXTS, "xyz"])
    with logit_bias(model, bias):
        free = HFEngine(model, tokenizer, decode="static").generate(
            prompts, sampling=SamplingParams(max_new_tokens=20, seed=3)
        )
        stop = tokenizer.batch_decode(free["responses"])[0][5:7]
        sampling = SamplingParams(max_new_tokens=20, seed=3, stop=[stop, "#"])
        dyn, sta = _both(model, tokenizer, prompts, 2, sampling)
    assert sta["response_mask"].sum(1).min() < 20  # some row stopped
    _same(dyn, sta)


def test_shared_prefill_and_micro_batches(model, tokenizer, encode):
    sampling = SamplingParams(max_new_tokens=8, seed=6)
    prompts = encode([TEXTS[0], TEXTS[2], TEXTS[0]])  # a repeated prompt too
    dyn, sta = _both(model, tokenizer, prompts, 4, sampling)
    _same(dyn, sta)
    (small,) = _both(model, tokenizer, prompts, 4, sampling, modes=("static",), micro_batch_size=5)
    _same(sta, small)


def test_static_equals_dynamic_with_lora(model, tokenizer, encode):
    model = apply_lora(model, lora_rank=4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    sampling = SamplingParams(temperature=0.7, max_new_tokens=8, seed=4)
    dyn, sta = _both(model, tokenizer, encode(TEXTS), 2, sampling)
    _same(dyn, sta)


def test_eager_attention_and_bf16(model, tokenizer, encode):
    model.config._attn_implementation = "eager"
    dyn, sta = _both(model, tokenizer, encode(TEXTS), 2, SamplingParams(max_new_tokens=6, seed=7))
    _same(dyn, sta)
    model = model.to(torch.bfloat16)
    dyn, sta = _both(model, tokenizer, encode(TEXTS), 2, SamplingParams(max_new_tokens=6, seed=7))
    assert dyn["responses"].shape == sta["responses"].shape  # bf16: shapes, not bits


class _FakeGraph:
    """Stands in for a captured CUDA graph on the CPU: replay = one eager step."""

    def __init__(self, decode):
        self.decode, self.replays = decode, 0

    def replay(self):
        self.replays += 1
        self.decode._advance()


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_new_tokens=12, seed=1),
        SamplingParams(max_new_tokens=12, seed=1, stop=["e", "q"]),
        SamplingParams(max_new_tokens=4, seed=2, ignore_eos=True),
        SamplingParams(max_new_tokens=3, seed=2),
    ],
    ids=["eos", "stop", "four", "three"],
)
def test_graph_loop_replays_each_step_once(
    model, tokenizer, encode, logit_bias, monkeypatch, sampling
):
    """The loop around the graph (warm-up step, capture, replays, host checks) on the CPU: a
    fake capture runs its warm-up step eagerly and returns a graph whose replay is a step."""
    graphs = []

    def capture(self):  # the captured step does not run
        graphs.append(_FakeGraph(self))
        return graphs[-1]

    monkeypatch.setattr(static_mod.StaticDecode, "_capture", capture)
    monkeypatch.setattr(static_mod, "resolve_decode", lambda mode, device: mode)
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS] = 3.0
    with logit_bias(model, bias):
        dyn, gra = _both(model, tokenizer, encode(TEXTS), 3, sampling, modes=("dynamic", "graphs"))
    _same(dyn, gra)
    steps = dyn["responses"].shape[1]
    if sampling.max_new_tokens >= 4:
        # steps 0 (prefill logits) and 1 (warm-up) run outside the graph; the host may let it
        # run up to check_every steps past the last row's end
        assert len(graphs) == 1 and steps - 2 <= graphs[0].replays <= sampling.max_new_tokens - 2
    else:
        assert not graphs


def test_modes_and_fallbacks(model, caplog):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_decode("auto", cpu) == "dynamic"
    assert resolve_decode("auto", cuda) == "graphs"  # measured: docs/performance.md
    assert resolve_decode("static", cpu) == "static"
    with caplog.at_level(logging.WARNING, logger="lmrl.rollout.static"):
        static_mod._WARNED.clear()
        assert resolve_decode("graphs", cpu) == "dynamic"
        assert resolve_decode("graphs", cpu) == "dynamic"
    assert sum("needs CUDA" in r.message for r in caplog.records) == 1  # said once
    with pytest.raises(ValueError, match="decode must be one of"):
        HFEngine(model, decode="fast")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmrl.rollout.static"):
        static_mod._WARNED.clear()
        HFEngine(model, decode="graphs")  # on a GPU that will decode with graphs: no fallback
    assert not caplog.records  # said only where a CPU decodes (above)
    assert static_supported(model) is None
    model.config._attn_implementation = "flash_attention_2"
    assert "4D" in static_supported(model)


def test_auto_keeps_sessions_on_the_dynamic_cache(model, tokenizer, encode, monkeypatch):
    """Where ``auto`` means graphs (CUDA), a multi-turn session still grows a DynamicCache
    (the static session cache is not timed on a GPU); ``static`` asks for it."""
    from transformers import DynamicCache

    monkeypatch.setattr(static_mod, "resolve_decode", lambda mode, device: "graphs")
    attn = torch.ones(2, 3, dtype=torch.bool)
    for mode, kind in (("auto", type(None)), ("static", static_mod.SessionKV)):
        engine = HFEngine(model, tokenizer, decode=mode)
        cache = DynamicCache(config=model.config)
        ids = torch.ones(2, 3, dtype=torch.long)
        engine._forward(ids, attn.long(), torch.arange(3).expand(2, 3), cache)
        assert type(static_mod.session_kv(engine, cache, attn)) is kind


def _session_turns(model, tokenizer, prompts, sampling, mode, stop=()):
    session = HFEngine(model, tokenizer, decode=mode).open_session(prompts, 2, sampling)
    assert (session.kv is None) == (mode == "dynamic")
    rows = torch.ones(6, dtype=torch.bool)
    turns = [session.generate(rows, list(stop), torch.full((6,), 5))]
    session.append({0: [5, 6, 7], 3: [9], 4: []})
    turns.append(session.generate(rows & (torch.arange(6) != 2), list(stop), torch.full((6,), 4)))
    session.append({r: [11 + r] * (r + 1) for r in range(6)})
    turns.append(session.generate(rows, list(stop), torch.full((6,), 7)))
    session.close()
    return turns


def _same_turns(a, b):
    for turn_a, turn_b in zip(a, b, strict=True):
        for (tok_a, lp_a, why_a), (tok_b, lp_b, why_b) in zip(turn_a, turn_b, strict=True):
            assert tok_a == tok_b and why_a == why_b
            torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), atol=ATOL, rtol=0)


@pytest.mark.parametrize("spare", [256, 2])  # 2: the buffers grow during the session
def test_static_session_equals_dynamic(model, tokenizer, encode, logit_bias, monkeypatch, spare):
    monkeypatch.setattr(static_mod.SessionKV, "spare", spare)
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS] = 3.0  # some turns end at EOS
    sampling = SamplingParams(max_new_tokens=6, seed=8)
    with logit_bias(model, bias):
        dyn, sta = (
            _session_turns(model, tokenizer, encode(TEXTS), sampling, mode)
            for mode in ("dynamic", "static")
        )
    assert {why for turn in dyn for _, _, why in turn} >= {"eos", "length"}
    _same_turns(dyn, sta)
    # both fold their one-column feeds (`decode_attention`): the model's own attention agrees
    monkeypatch.setattr(static_mod, "FOLD_GQA", False)
    with logit_bias(model, bias):
        own = _session_turns(model, tokenizer, encode(TEXTS), sampling, "dynamic")
    _same_turns(own, dyn)


def test_static_session_with_stop_strings(model, tokenizer, encode, logit_bias):
    bias = torch.full((model.config.vocab_size,), -1e4)
    bias[ord("a") : ord("e") + 1] = 0.0  # five letters: stops come soon
    sampling = SamplingParams(max_new_tokens=6, seed=9)
    with logit_bias(model, bias):
        dyn, sta = (
            _session_turns(model, tokenizer, encode(TEXTS), sampling, mode, stop=["ab", "c"])
            for mode in ("dynamic", "static")
        )
    assert "stop" in {why for turn in dyn for _, _, why in turn}
    _same_turns(dyn, sta)


# ---------------------------------------------------------------------------------- CUDA
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _captured(monkeypatch) -> list:
    seen = []
    capture = static_mod.StaticDecode._capture

    def spy(self):
        graph = capture(self)
        seen.append(graph is not None)
        return graph

    monkeypatch.setattr(static_mod.StaticDecode, "_capture", spy)
    return seen


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_equal_eager(model, tokenizer, encode, logit_bias, monkeypatch, dtype):
    model = model.to("cuda", dtype)
    seen = _captured(monkeypatch)
    bias = torch.zeros(model.config.vocab_size, device="cuda", dtype=dtype)
    bias[EOS] = 3.0
    for sampling in (
        SamplingParams(max_new_tokens=40, seed=1),
        SamplingParams(max_new_tokens=24, seed=2, ignore_eos=True, top_p=0.9, top_k=50),
        SamplingParams(max_new_tokens=16, do_sample=False),
    ):
        with logit_bias(model, bias):
            outs = _both(
                model, tokenizer, encode(TEXTS), 4, sampling, modes=("static", "graphs", "dynamic")
            )
        sta, gra, dyn = outs
        _same(sta, gra, atol=1e-6 if dtype == torch.float32 else 1e-3)
        if dtype == torch.float32:  # bf16: the cache widths change the sums' rounding
            _same(dyn, gra, atol=1e-4)
    assert seen and all(seen)  # every call captured a graph, none fell back


@gpu
@needs_cuda
def test_cuda_graphs_with_fused_norms_equal_the_dynamic_loop(
    model, tokenizer, encode, logit_bias, monkeypatch
):
    """FUSED_NORM on CUDA (torch's fused rms_norm kernel), in fp32: the graphs give the dynamic
    loop's tokens and log-probs (within float32 rounding of another reduction order)."""
    model = model.to("cuda")
    monkeypatch.setattr(static_mod, "FUSED_NORM", True)
    bias = torch.zeros(model.config.vocab_size, device="cuda")
    bias[EOS] = 3.0
    sampling = SamplingParams(max_new_tokens=40, seed=1)
    with logit_bias(model, bias):
        dyn, gra = _both(model, tokenizer, encode(TEXTS), 4, sampling, modes=("dynamic", "graphs"))
    _same(dyn, gra, atol=1e-4)


@gpu
@needs_cuda
def test_cuda_graphs_of_several_widths_share_a_pool(model, tokenizer, encode, monkeypatch):
    """A graph per width bucket (8 columns), captured into one memory pool and replayed in
    turn, gives the eager static path's tokens and the dynamic loop's."""
    monkeypatch.setattr(static_mod, "BUCKET", 8)
    model = model.to("cuda")
    seen = _captured(monkeypatch)
    sampling = SamplingParams(max_new_tokens=40, seed=5, ignore_eos=True)
    sta, gra, dyn = _both(
        model, tokenizer, encode(TEXTS), 4, sampling, modes=("static", "graphs", "dynamic")
    )
    _same(sta, gra, atol=1e-6)
    _same(dyn, gra, atol=1e-4)
    assert len(seen) >= 5 and all(seen)  # one capture per width, none fell back


@gpu
@needs_cuda
def test_cuda_graphs_under_autocast_over_fp32_weights(model, tokenizer, encode, monkeypatch):
    """The trainer's default on CUDA: bf16 autocast over fp32 weights around the whole
    generate (`PrecisionEngine`). The graphs read the autocast cache's bf16 weights, cast by
    the eager warm-up step and alive until the call ends: the eager static path's tokens."""
    monkeypatch.setattr(static_mod, "BUCKET", 16)
    model = model.to("cuda", torch.float32)
    seen = _captured(monkeypatch)
    sampling = SamplingParams(max_new_tokens=40, seed=6, ignore_eos=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        sta, gra = _both(model, tokenizer, encode(TEXTS), 4, sampling, modes=("static", "graphs"))
    _same(sta, gra, atol=1e-3)
    assert seen and all(seen)


@gpu
@needs_cuda
def test_cuda_graphs_with_stop_strings(model, tokenizer, encode, logit_bias, monkeypatch):
    model = model.to("cuda")
    seen = _captured(monkeypatch)
    bias = torch.full((model.config.vocab_size,), -1e4, device="cuda")
    bias[ord("a") : ord("z") + 1] = 0.0
    prompts = encode([*TEXTS, "xyz"])
    with logit_bias(model, bias):
        free = HFEngine(model, tokenizer, decode="static").generate(
            prompts, sampling=SamplingParams(max_new_tokens=20, seed=3)
        )
        stop = tokenizer.batch_decode(free["responses"])[0][5:7]
        sampling = SamplingParams(max_new_tokens=20, seed=3, stop=[stop])
        sta, gra = _both(model, tokenizer, prompts, 2, sampling, modes=("static", "graphs"))
    _same(sta, gra, atol=1e-6)
    assert seen and all(seen)


@gpu
@needs_cuda
def test_cuda_sessions_static_equal_dynamic(model, tokenizer, encode):
    model = model.to("cuda")
    sampling = SamplingParams(max_new_tokens=6, seed=8)
    dyn, sta = (
        _session_turns(model, tokenizer, encode(TEXTS), sampling, mode)
        for mode in ("dynamic", "graphs")  # graphs on CUDA: the static session cache
    )
    _same_turns(dyn, sta)


def test_config_keys_reach_the_engine():
    from lmrl.config import ConfigError, load_config
    from lmrl.rollout.engines import engine_options

    cfg = load_config(
        overrides=["rollout.hf.decode=static", "rollout.hf.check_every=4"], required=()
    )
    assert engine_options(cfg) == {"decode": "static", "check_every": 4}
    assert engine_options(load_config(required=()))["decode"] == "auto"
    with pytest.raises(ConfigError):
        load_config(overrides=["rollout.hf.decode=fast"], required=())


def test_a_static_layer_stores_in_its_buffers_dtype():
    """Under autocast, transformers 5.17's prefill cache holds values in the keys' dtype (fp32
    after the rotary embedding) while a decode step's values come out bf16: the static layer
    writes each step in its buffers' dtypes, as concatenating onto the prefill's cache does."""
    from lmrl.rollout.static import _static_layer_class

    keys, values = torch.zeros(2, 1, 4, 3), torch.zeros(2, 1, 4, 3)
    col = torch.tensor([1])
    layer = _static_layer_class()(keys, values, col)
    k, v = torch.ones(2, 1, 1, 3), torch.full((2, 1, 1, 3), 0.5, dtype=torch.bfloat16)
    out_k, out_v = layer.update(k, v, 0)
    assert out_k.dtype == out_v.dtype == torch.float32
    assert torch.equal(out_v[:, :, 1], torch.full((2, 1, 3), 0.5)) and out_v[:, :, 0].eq(0).all()


@pytest.mark.parametrize("mask_kind", ["additive", "bool", "none"])
@pytest.mark.parametrize("matmul", [True, False])
@pytest.mark.parametrize(("length", "kv_heads"), [(1, 2), (3, 2), (1, 6)])
def test_decode_attention_equals_repeat_kv_attention(length, kv_heads, matmul, mask_kind,
                                                     monkeypatch):  # fmt: skip
    """The folded grouped-query attention (two matmuls, as on a CPU, or sdpa, as on a GPU)
    gives transformers' sdpa over keys and values copied to every query head (``repeat_kv``),
    with an additive or boolean mask of masked columns or none; so do several query tokens
    and a model without grouped queries."""
    from transformers.integrations.sdpa_attention import repeat_kv

    from lmrl.rollout.static import decode_attention

    monkeypatch.setattr(static_mod, "MATMUL_DEVICES", ("cpu",) if matmul else ())
    gen = torch.Generator().manual_seed(0)
    rows, heads, width, dim = 3, 6, 11, 8
    groups = heads // kv_heads
    query = torch.randn(rows, heads, length, dim, generator=gen)
    key, value = (torch.randn(rows, kv_heads, width, dim, generator=gen) for _ in range(2))
    allowed = torch.rand(rows, 1, length, width, generator=gen) > 0.3
    allowed[..., -1] = True
    mask = {
        "additive": torch.zeros(allowed.shape).masked_fill(
            ~allowed, torch.finfo(torch.float32).min
        ),
        "bool": allowed,
        "none": None,
    }[mask_kind]
    want = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask, scale=0.3
    ).transpose(1, 2)
    layer = SimpleNamespace(num_key_value_groups=groups, is_causal=False)  # an attention layer
    got, weights = decode_attention(layer, query, key, value, mask, scaling=0.3, dropout=0.0)
    assert weights is None and got.shape == (rows, length, heads, dim)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_any_forward_under_the_decode_attention_is_the_models_own(model, encode):
    """While the decode attention is switched on (a decode runs), a full forward of padded
    prompts (another thread's, say) gives the logits the model's own attention gives."""
    prompts = encode(TEXTS)
    ids, mask = prompts["input_ids"], prompts["attention_mask"].long()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        with static_mod.decode_attention_on(model):
            assert model.config._attn_implementation == static_mod.ATTENTION
            got = model(input_ids=ids, attention_mask=mask).logits
            nopad = model(input_ids=ids[1:2, -1:], attention_mask=mask[1:2, -1:]).logits
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(nopad, want[1:2, -1:], atol=1e-5, rtol=0)
    assert model.config._attn_implementation == "sdpa"


def test_decode_steps_attend_folded_over_growing_widths(
    model, tokenizer, encode, logit_bias, monkeypatch
):
    """Every decode step runs `decode_attention` (never the prefill): today's loop over the
    cache it grew, the static decode over the cache's first columns rounded up to `BUCKET`, one
    graph per width (fake graphs on the CPU); the tokens and log-probs are those of the model's
    own attention, and the model's attention setting is restored."""
    monkeypatch.setattr(static_mod, "BUCKET", 8)
    widths = []
    fold = static_mod.decode_attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        assert attention_mask.shape[-1] == key.shape[2] == value.shape[2]
        widths.append(key.shape[2])
        return fold(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(static_mod, "decode_attention", spy)
    static_mod._registered.cache_clear()  # register the spy under the same name
    graphs = {}

    def capture(self):
        graphs[self.width] = _FakeGraph(self)
        return graphs[self.width]

    monkeypatch.setattr(static_mod.StaticDecode, "_capture", capture)
    monkeypatch.setattr(static_mod, "resolve_decode", lambda mode, device: mode)
    bias = torch.zeros(model.config.vocab_size)
    bias[EOS] = -1e4
    sampling = SamplingParams(max_new_tokens=20, seed=4)
    prompts = encode(TEXTS)
    try:
        with logit_bias(model, bias):
            dyn, sta, gra = _both(
                model, tokenizer, prompts, 2, sampling, modes=("dynamic", "static", "graphs")
            )
    finally:
        static_mod._registered.cache_clear()
    monkeypatch.setattr(static_mod, "FOLD_GQA", False)  # the model's own attention
    with logit_bias(model, bias):
        (own,) = _both(model, tokenizer, prompts, 2, sampling, modes=("dynamic",))
    for out in (dyn, sta, gra):
        _same(own, out)
    assert model.config._attn_implementation == "sdpa"
    layers, prompt_len = model.config.num_hidden_layers, prompts["input_ids"].shape[1]
    full = -(-(prompt_len + 19) // 8) * 8
    grown = [prompt_len + t for t in range(1, 20) for _ in range(layers)]
    expected = [min(full, -(-(prompt_len + t) // 8) * 8) for t in range(1, 20)]
    bucketed = [w for w in expected for _ in range(layers)]
    assert widths == grown + bucketed * 2  # dynamic, static, then graphs
    assert len(set(expected)) > 2 and sorted(graphs) == sorted(set(expected[1:]))
    assert sum(g.replays for g in graphs.values()) == 18  # steps 2..19; step 1 warms up


# ----------------------------------------------------------------- fused RMSNorm (FUSED_NORM)
@pytest.mark.parametrize(
    ("weight_dtype", "input_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
     (torch.float32, torch.bfloat16)],  # the last: fp32 masters, a bf16 stream
)  # fmt: skip
def test_the_fused_rms_norm_is_the_models_rms_norm(model, weight_dtype, input_dtype):
    """fp32 normalization rounded to the input's dtype, times the weight: transformers'
    Llama-style RMSNorm, to the last bit of the input's dtype (one ulp of bf16)."""
    norm = model.model.norm
    weight = torch.randn(norm.weight.shape, generator=torch.Generator().manual_seed(0))
    x = 3 * torch.randn(5, 2, weight.shape[0], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        norm.weight.copy_(weight)
        want = norm.to(weight_dtype)(x.to(input_dtype))
        got = static_mod._fused_rms_norm(norm, x.to(input_dtype))
    assert got.dtype == want.dtype
    tol = 1e-6 if want.dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, want, rtol=tol, atol=0)


def test_decode_steps_normalize_fused_where_asked(model, tokenizer, encode, monkeypatch):
    """With FUSED_NORM the static steps' RMSNorms (every layer's two and the final one) run
    through `_fused_rms_norm`: the tokens and masks of today's loop, log-probs to float32
    rounding; after the call the modules compute with their own forward again. Off (the
    default) or on another model type, they are left alone."""
    calls = []
    fused = static_mod._fused_rms_norm
    monkeypatch.setattr(static_mod, "_fused_rms_norm", lambda m, x: calls.append(1) or fused(m, x))
    sampling = SamplingParams(max_new_tokens=6, seed=7)
    prompts = encode(TEXTS)
    dyn, sta = _both(model, tokenizer, prompts, 2, sampling)
    assert not calls  # off by default
    monkeypatch.setattr(static_mod, "FUSED_NORM", True)
    (fused_sta,) = _both(model, tokenizer, prompts, 2, sampling, modes=("static",))
    norms = 2 * model.config.num_hidden_layers + 1
    assert len(calls) == norms * 5  # steps 1..5 (step 0 picks from the prefill's logits)
    _same(dyn, fused_sta)
    _same(sta, fused_sta)
    assert not any("forward" in vars(m) for m in model.modules())
    model.config.model_type = "gemma"  # its RMSNorm scales by 1 + weight
    calls.clear()
    _both(model, tokenizer, prompts, 2, sampling, modes=("static",))
    assert not calls
