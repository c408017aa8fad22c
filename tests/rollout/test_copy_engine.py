"""``rollout.dtype``: the ``hf`` engine over a copy of the actor's weights in another dtype."""

from __future__ import annotations

import torch

from lmrl.models import compute_log_probs
from lmrl.models.loading import bump_weights_version
from lmrl.rollout import SamplingParams
from lmrl.rollout.copy import CopyEngine
from lmrl.rollout.engines import build_engine
from lmrl.rollout.hf import HFEngine

TEXTS = ["hello", "a", "what is 2+2?"]


def _gap(model, out) -> torch.Tensor:
    """|actor log-prob - rollout log-prob| over the response tokens of ``out``."""
    actor, _ = compute_log_probs(model, out, micro_batch_size=len(out))
    return (actor - out["rollout_log_probs"])[out["response_mask"]].abs()


def test_the_engine_copies_only_for_another_dtype(model, tokenizer):
    assert type(build_engine("hf", model, tokenizer)) is HFEngine
    assert type(build_engine("hf", model, tokenizer, dtype="float32")) is HFEngine  # its own
    engine = build_engine("hf", model, tokenizer, dtype="bfloat16")
    assert type(engine) is CopyEngine and not engine.shares_weights
    assert {p.dtype for p in engine.copy.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the actor is untouched


def test_a_bf16_copy_has_a_real_gap_and_the_fp32_engine_none(model, tokenizer, encode):
    prompts = encode(TEXTS)
    sampling = SamplingParams(max_new_tokens=8, seed=0)
    own = HFEngine(model, tokenizer).generate(prompts, n=2, sampling=sampling)
    bf16 = CopyEngine(model, tokenizer, dtype="bfloat16").generate(prompts, n=2, sampling=sampling)
    own_gap, gap = _gap(model, own), _gap(model, bf16)
    assert own_gap.max() < 1e-5  # float32 rounding only (measured ~1e-7)
    # bf16's 8-bit mantissa: measured ~7e-4 on this near-uniform tiny model; a broken copy
    # (stale or wrong weights) would be far above 0.1
    assert gap.mean() > 100 * own_gap.mean() and gap.mean() > 1e-4 and gap.max() < 0.1


def test_the_copy_follows_the_actor_after_an_update(model, tokenizer, encode):
    engine = CopyEngine(model, tokenizer, dtype="bfloat16")
    prompts, sampling = encode(TEXTS), SamplingParams(max_new_tokens=4, seed=1)
    engine.generate(prompts, sampling=sampling)
    assert engine.sync_count == 1  # nothing changed: no copy before the call
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # an in-place write: torch's version counters see it
    engine.generate(prompts, sampling=sampling)
    assert engine.sync_count == 2
    for (name, a), b in zip(model.state_dict().items(), engine.copy.state_dict().values(),
                            strict=True):  # fmt: skip
        assert torch.equal(a.to(torch.bfloat16), b), name
    bump_weights_version(model)  # a fused optimizer's write: only the trainer's counter moves
    engine.generate(prompts, sampling=sampling)
    assert engine.sync_count == 3
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)


def test_the_copy_scores_as_a_bf16_model_would(model, tokenizer, encode):
    """The rollout log-probs are the bf16 copy's own: recomputing them with the copy agrees."""
    engine = CopyEngine(model, tokenizer, dtype="bfloat16")
    out = engine.generate(encode(TEXTS), n=2, sampling=SamplingParams(max_new_tokens=6, seed=2))
    lp, _ = compute_log_probs(engine.copy, out, micro_batch_size=len(out))
    mask = out["response_mask"]
    assert (lp.float() - out["rollout_log_probs"])[mask].abs().max() < 0.05
