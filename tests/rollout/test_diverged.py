"""A policy whose weights went NaN: sampling raises one `DivergedError` naming the cause and
the key to change, never an indexing traceback from the draw."""

from __future__ import annotations

import re

import pytest
import torch

from lmrl.errors import DivergedError, LmrlError
from lmrl.rollout import HFEngine, SamplingParams
from lmrl.rollout.sampling import DRAW_BLOCK, Draws, _draw, check_finite, pick

MESSAGE = "the policy's logits are not finite (NaN/inf) while sampling"


def _diverge(model, value: float = float("nan")):
    """Every weight of ``model`` set to ``value`` (what a learning rate of 1e12 leaves)."""
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(value)
    return model


@pytest.mark.parametrize("decode", ["dynamic", "static"])
@pytest.mark.parametrize("do_sample", [True, False])
def test_nan_weights_raise_one_diverged_error(model, tokenizer, encode, decode, do_sample):
    engine = HFEngine(_diverge(model), tokenizer, decode=decode)
    sampling = SamplingParams(max_new_tokens=4, seed=0, do_sample=do_sample)
    with pytest.raises(DivergedError) as info:
        engine.generate(encode(["hello", "a"]), n=2, sampling=sampling)
    text = str(info.value)
    assert isinstance(info.value, LmrlError) and "\n" not in text
    assert text.startswith(MESSAGE) and "actor.optim.lr" in text


def test_rows_whose_logits_are_not_finite_stop_at_once(model, tokenizer, encode):
    """The dynamic decode ends such rows at their first token (no host sync of its own), so a
    diverged policy does not decode ``max_new_tokens`` of garbage before the error."""
    engine = HFEngine(_diverge(model), tokenizer, decode="dynamic")
    widths: list[int] = []
    engine.set_row_done(lambda rows, block: widths.append(block["responses"].shape[1]))
    with pytest.raises(DivergedError):
        engine.generate(encode(["hello", "a"]), n=2, sampling=SamplingParams(max_new_tokens=64))
    assert widths == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decode", ["graphs", "dynamic"])
def test_nan_weights_raise_on_cuda_without_a_device_assert(model, tokenizer, encode, decode):
    """On CUDA an out-of-range token id is a device-side assert that kills the process; the
    draw keeps the id in range and the call raises the one line, after which the device
    still works."""
    engine = HFEngine(_diverge(model.cuda()), tokenizer, decode=decode)
    with pytest.raises(DivergedError, match=re.escape(MESSAGE)):
        engine.generate(encode(["hello", "a"]), n=2, sampling=SamplingParams(max_new_tokens=8))
    assert torch.ones(2, device="cuda").sum().item() == 2.0


def test_nan_weights_raise_in_a_multi_turn_session(model, tokenizer, encode):
    engine = HFEngine(_diverge(model), tokenizer)
    session = engine.open_session(encode(["hello", "a"]), 1, SamplingParams(seed=0))
    try:
        with pytest.raises(DivergedError, match=r"actor\.optim\.lr"):
            session.generate(torch.ones(2, dtype=torch.bool), [], torch.full((2,), 3))
    finally:
        session.close()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("vocab", [259, 4 * DRAW_BLOCK + 3])  # one-level and two-level draw
def test_non_finite_logits_draw_a_token_in_range_with_a_non_finite_log_prob(value, vocab):
    logits = torch.randn(3, vocab)
    logits[0] = value  # a whole row
    logits[1, 7] = value  # one entry
    draws = Draws(0, torch.arange(3))
    for do_sample in (True, False):
        token, logp = pick(logits, SamplingParams(seed=0, do_sample=do_sample), draws, 0)
        assert ((token >= 0) & (token < vocab)).all()
        assert not torch.isfinite(logp[0])
        assert torch.isfinite(logp[2])  # a finite row is untouched
        with pytest.raises(DivergedError):
            check_finite(logp)
    probs = torch.full((2, vocab), float("nan"))
    assert (_draw(probs, torch.rand(2, 1, dtype=torch.float64)) < vocab).all()


def test_finite_log_probs_pass():
    check_finite(torch.tensor([[-0.5, -3.0, 0.0]]))  # 0 where no token was sampled


def test_lmrl_train_whose_weights_diverge_ends_in_one_line(tiny_workspace, tmp_path, capsys):
    from lmrl.cli import main

    code = main([
        "train",
        f"model.path={tiny_workspace / 'model'}",
        f"data.train_files={tiny_workspace / 'data' / 'train.parquet'}",
        "data.train_batch_size=4",
        "data.max_response_length=8",
        "actor.ppo_mini_batch_size=4",
        "actor.optim.lr=1e12",  # one update leaves the weights inf/NaN
        "trainer.total_training_steps=2",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"lmrl train: error: {MESSAGE}" in err and "Traceback" not in err
