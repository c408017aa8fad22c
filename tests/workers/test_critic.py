"""The critic worker: values of a batch, an update that fits the returns, and micro-batch
invariance of that update."""

from __future__ import annotations

import pytest
import torch
from tests.host_reads import HostReads

from lmrl.models import load_critic
from lmrl.workers import critic as critic_module


def _critic(tiny_dir, dtype=torch.float32, seed=0):
    """The critic with a random value head (a fresh one is 0, which zeroes every gradient
    but the head's)."""
    model = load_critic(tiny_dir).to(dtype)
    with torch.no_grad():
        weight = model.score.weight
        weight.copy_(0.1 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed)))
    return model


def _with_targets(batch, critic, seed=2):
    """``values`` as the rollout would record them, ``returns`` seeded in [0, 1)."""
    mask = batch["response_mask"]
    batch["values"] = critic.compute_values(batch)
    returns = torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed))
    batch["returns"] = torch.where(mask, returns, 0.0)
    return batch


def _mse(values, batch):
    mask = batch["response_mask"]
    return float(((values - batch["returns"])[mask] ** 2).mean())


def test_compute_values_shape_and_micro_batching(tiny_dir, batch_factory, critic_factory):
    batch = batch_factory()
    mask = batch["response_mask"]
    fresh = critic_factory(load_critic(tiny_dir)).compute_values(batch)
    assert fresh.shape == mask.shape and fresh.dtype == torch.float32
    assert (fresh == 0).all()  # a new value head starts at 0
    whole = critic_factory(_critic(tiny_dir)).compute_values(batch)
    one_row = critic_factory(_critic(tiny_dir), ppo_micro_batch_size=1).compute_values(batch)
    assert (whole[~mask] == 0).all() and whole[mask].abs().min() > 0
    torch.testing.assert_close(one_row, whole, atol=1e-6, rtol=0)


def test_one_update_lowers_the_value_loss(tiny_dir, batch_factory, critic_factory):
    critic = critic_factory(load_critic(tiny_dir), cliprange_value=10.0)
    batch = _with_targets(batch_factory(), critic)
    before = _mse(batch["values"], batch)
    metrics = critic.update_critic(batch)
    assert set(metrics) == {"critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm",
                            "critic/lr"}  # fmt: skip
    assert float(metrics["critic/vf_loss"]) == pytest.approx(0.5 * before, rel=1e-5)
    after = _mse(critic.compute_values(batch), batch)
    assert after < 0.9 * before


def test_the_update_does_not_depend_on_the_micro_batch_size(
    tiny_dir, batch_factory, critic_factory, step_grads, grads_close
):
    steps = step_grads(critic_module)
    metrics = []
    for micro in (None, 1, 4):
        critic = critic_factory(
            _critic(tiny_dir, torch.float64), ppo_micro_batch_size=micro, cliprange_value=0.05
        )
        batch = _with_targets(batch_factory(), critic)
        batch["values"] = batch["values"] + 0.1  # the clip bites on some tokens
        metrics.append(critic.update_critic(batch))
    assert len(steps) == 3
    assert 0 < float(metrics[0]["critic/vf_clipfrac"]) < 1
    for i in (1, 2):
        grads_close(steps[i], steps[0], tol=1e-6)  # values leave the model as float32
        for key in ("critic/vf_loss", "critic/vf_clipfrac"):
            torch.testing.assert_close(metrics[i][key], metrics[0][key], rtol=1e-6, atol=0)


def test_a_micro_batch_of_the_update_reads_nothing_back(
    tiny_dir, batch_factory, critic_factory, monkeypatch
):
    """The critic's forward, value loss and backward per micro-batch read nothing back from
    the device (the rows' layout is read once, before); without the layout they do."""
    worker = critic_factory(_critic(tiny_dir), ppo_micro_batch_size=2)
    batch = _with_targets(batch_factory(), worker)
    reads = HostReads()
    for name in ("forward_values", "value_loss"):
        real = getattr(critic_module, name)

        def watched(*args, real=real, **kwargs):
            with reads:
                out = real(*args, **kwargs)
                if isinstance(out, torch.Tensor):
                    out.sum().backward(retain_graph=True)
                return out

        monkeypatch.setattr(critic_module, name, watched)
    worker.update_critic(batch)
    assert reads.reads == []
    monkeypatch.setattr(critic_module, "with_row_layout", lambda batch: batch)
    worker.update_critic(batch)
    assert any("trim_batch" in where for _, where in reads.reads)


def test_rows_no_reward_scored_are_not_fitted(tiny_dir, batch_factory, critic_factory,
                                              step_grads, grads_close):  # fmt: skip
    """A row with ``scored_mask`` False has no return to fit: whatever its returns, the
    critic's step is the same; with the mask gone, the same change moves the step."""
    steps = step_grads(critic_module)
    metrics = []
    for unscored_return, with_mask in ((0.0, True), (100.0, True), (100.0, False)):
        critic = critic_factory(_critic(tiny_dir, torch.float64), cliprange_value=10.0)
        batch = _with_targets(batch_factory(), critic)
        scored = torch.ones(len(batch), dtype=torch.bool)
        scored[0] = False
        batch["returns"][0] = torch.where(batch["response_mask"][0], unscored_return, 0.0)
        if with_mask:
            batch["scored_mask"] = scored
        metrics.append(critic.update_critic(batch))
    grads_close(steps[1], steps[0], tol=1e-9)
    torch.testing.assert_close(metrics[1]["critic/vf_loss"], metrics[0]["critic/vf_loss"])
    assert float(metrics[2]["critic/vf_loss"]) > 10 * float(metrics[0]["critic/vf_loss"])
