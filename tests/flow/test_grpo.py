"""Flow-GRPO's rollout layout and update: on-policy ratios, advantages, accumulation, the
reference as the adapter-off model, and learning on the 2-D toy flow."""

from __future__ import annotations

import copy

import pytest
import torch
from tests.host_reads import HostReads

from lmrl.flow import (
    FlowGRPO,
    FlowGRPOConfig,
    FlowSampler,
    PointFlow,
    flow_advantages,
    pretrain,
    right_side_reward,
    two_blobs,
)


@pytest.fixture(scope="module")
def pretrained():
    """The toy flow pre-trained by flow matching (about 2 s)."""
    torch.manual_seed(0)
    model = PointFlow()
    losses = pretrain(model, two_blobs, steps=1500, batch_size=256, lr=2e-3, uncond_id=4)
    assert sum(losses[-50:]) / 50 < 0.8 * sum(losses[:50]) / 50
    return model


def _rollout(model, sampler, prompts=8, n=8, seed=1, uncond=False):
    gen = torch.Generator().manual_seed(seed)
    cond = torch.randint(4, (prompts,), generator=gen).repeat_interleave(n)
    noise = torch.randn(prompts * n, 2, generator=gen)
    un = torch.full_like(cond, 4) if uncond else None
    return sampler.sample(model, cond, noise, uncond=un, generator=gen), cond, un


def test_the_rollout_keeps_every_step_and_marks_the_ones_that_train(pretrained):
    sampler = FlowSampler(num_steps=8, sde_start=2, sde_steps=4, timestep_fraction=0.5)
    batch, _, _ = _rollout(pretrained, sampler, prompts=2, n=3)
    assert batch["latents"].shape == (6, 8, 2) and batch["log_probs"].shape == (6, 8)
    assert torch.equal(batch["latents"][:, 1:], batch["next_latents"][:, :-1])
    assert torch.equal(batch["images"], batch["next_latents"][:, -1])
    sde = [False, False, True, True, True, True, False, False]
    assert sampler.sde_mask().tolist() == sde
    assert batch["step_mask"][0].tolist() == [False, False, True, True] + [False] * 4
    ode_steps = ~torch.tensor(sde)
    assert (batch["log_probs"][:, ode_steps] == 0).all()
    assert (batch["log_probs"][:, ~ode_steps] != 0).all()
    assert torch.allclose(batch["timesteps"][0], torch.linspace(1, 0, 9)[:-1])
    with pytest.raises(ValueError, match="sde_start"):
        FlowSampler(num_steps=4, sde_start=4)


def test_a_window_range_places_the_window_anew_in_each_rollout(pretrained):
    sampler = FlowSampler(num_steps=8, sde_steps=2, window_range=(1, 7))
    grpo = FlowGRPO(pretrained, sampler, None, FlowGRPOConfig())
    starts = []
    for seed in range(40):
        batch, _, _ = _rollout(pretrained, sampler, prompts=1, n=2, seed=seed)
        mask = batch["step_mask"][0]
        start = int(mask.long().argmax())
        assert mask.tolist() == [start <= j < start + 2 for j in range(8)]
        assert (batch["log_probs"][:, ~mask] == 0).all() and (
            batch["log_probs"][:, mask] != 0
        ).all()
        # the update recomputes the steps the window trained, and finds the rollout's
        assert (grpo.old_log_probs(batch) - batch["log_probs"]).abs().max() < 1e-5
        starts.append(start)
    assert set(starts) == {1, 2, 3, 4, 5}  # lo .. hi - sde_steps
    again, _, _ = _rollout(pretrained, sampler, prompts=1, n=2, seed=39)  # the same generator
    assert torch.equal(again["step_mask"], batch["step_mask"])
    assert torch.equal(again["images"], batch["images"])
    with pytest.raises(ValueError, match="window_range needs sde_steps"):
        FlowSampler(num_steps=8, window_range=(0, 8))
    for bad in ((0, 9), (3, 4), (-1, 4)):
        with pytest.raises(ValueError, match="must hold a window of 2 steps inside the 8"):
            FlowSampler(num_steps=8, sde_steps=2, window_range=bad)


def test_the_ratio_clips_at_its_own_low_and_high_bounds(pretrained):
    sampler = FlowSampler(num_steps=4)
    batch, cond, _ = _rollout(pretrained, sampler)
    adv = flow_advantages(right_side_reward(batch["images"]), cond.tolist())
    moved = copy.deepcopy(pretrained)
    with torch.no_grad():  # a policy the rollout no longer matches: ratios away from 1
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    fractions = {}
    for bounds in ((None, None), (10.0, None), (None, 10.0), (10.0, 10.0)):
        model = copy.deepcopy(moved)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        low, high = bounds
        settings = FlowGRPOConfig(clip_range=1e-4, clip_range_low=low, clip_range_high=high)
        metrics = FlowGRPO(model, sampler, opt, settings).update(batch, adv)
        fractions[bounds] = metrics["actor/pg_clipfrac"]
    both, wide_low, wide_high, wide = (fractions[b] for b in fractions)
    assert both > 0 and wide == 0  # 1e-4 both ways clips; 10 both ways clips nothing
    assert 0 < wide_low < both and 0 < wide_high < both  # each side clips its own share
    assert wide_low + wide_high == pytest.approx(both)


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_recomputed_log_probs_equal_the_rollouts_so_nothing_clips_at_first(pretrained, guidance):
    model = copy.deepcopy(pretrained)
    sampler = FlowSampler(num_steps=6, guidance_scale=guidance)
    batch, cond, un = _rollout(model, sampler, uncond=guidance != 1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grpo = FlowGRPO(model, sampler, opt, FlowGRPOConfig(clip_range=1e-4))
    old = grpo.old_log_probs(batch, uncond=un)
    assert (old - batch["log_probs"]).abs().max() < 1e-5  # ratio 1 within 1e-5
    adv = flow_advantages(right_side_reward(batch["images"]), cond.tolist())
    metrics = grpo.update(batch, adv, old_log_probs=old, uncond=un)
    assert metrics["actor/pg_clipfrac"] == 0.0 and abs(metrics["actor/ppo_kl"]) < 1e-5
    assert metrics["actor/grad_norm"] > 0


def test_advantages_are_grpos_per_prompt_group_clipped():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0, 5.0, 5.0, 5.0, 5.0])
    index = ["a"] * 4 + ["b"] * 4
    adv = flow_advantages(scores, index, adv_clip_max=1.0)
    first = (scores[:4] - scores[:4].mean()) / (scores[:4].std() + 1e-6)
    assert torch.allclose(adv[:4], first.clamp(-1, 1)) and adv[0] == 1.0
    assert (adv[4:] == 0).all()  # a group with no spread teaches nothing
    dr = flow_advantages(scores, index, norm_adv_by_std=False)
    assert torch.allclose(dr[:4], scores[:4] - 0.25)


def _one_update(model, batch, adv, **config):
    sampler = FlowSampler(num_steps=6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    FlowGRPO(
        model, sampler, opt, FlowGRPOConfig(clip_range=0.2, max_grad_norm=None, **config)
    ).update(batch, adv)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_micro_batches_and_steps_accumulate_to_the_whole_batch_loss(pretrained):
    batch, cond, _ = _rollout(pretrained, FlowSampler(num_steps=6), prompts=4, n=4)
    batch["step_mask"][:5, 3:] = False  # uneven steps per image: the mean is over all of them
    adv = flow_advantages(right_side_reward(batch["images"]), cond.tolist())
    whole = _one_update(copy.deepcopy(pretrained), batch, adv)
    pieces = _one_update(copy.deepcopy(pretrained), batch, adv, micro_batch_size=4)
    before = torch.cat([p.detach().flatten() for p in pretrained.parameters()])
    assert not torch.allclose(whole, before)
    assert torch.allclose(whole, pieces, atol=1e-6)


def test_the_update_reads_the_device_back_per_update_not_per_micro_batch(pretrained):
    """The steps each micro-batch trains are chosen on the host from one read of the rollout's
    step mask: the update's host reads do not grow with its micro-batches (they did: one read
    of the steps' counts per micro-batch)."""
    batch, cond, _ = _rollout(pretrained, FlowSampler(num_steps=6), prompts=4, n=4)
    batch["step_mask"][:5, 3:] = False
    adv = flow_advantages(right_side_reward(batch["images"]), cond.tolist())
    counts = []
    for micro in (16, 4, 1):
        with HostReads() as reads:
            _one_update(copy.deepcopy(pretrained), batch, adv, micro_batch_size=micro)
        counts.append(len(reads.reads))
    assert counts[0] == counts[1] == counts[2], counts


def test_std_scale_weights_each_steps_gradient_by_2_25_sigma(pretrained):
    sampler = FlowSampler(num_steps=6)
    batch, cond, _ = _rollout(pretrained, sampler, prompts=2, n=4)
    batch["step_mask"][:] = False
    batch["step_mask"][:, 2] = True
    adv = flow_advantages(right_side_reward(batch["images"]) + torch.arange(8) * 0.1, cond.tolist())
    base = torch.cat([p.detach().flatten() for p in pretrained.parameters()])
    plain = _one_update(copy.deepcopy(pretrained), batch, adv) - base
    scaled = _one_update(copy.deepcopy(pretrained), batch, adv, std_scale=True) - base
    t = sampler.times[2]
    sigma = 0.7 * torch.sqrt(t / (1 - t))
    assert torch.allclose(scaled, plain * 2.25 * sigma, atol=1e-6)


def test_the_reference_is_the_adapter_off_model_and_never_changes(pretrained):
    from peft import LoraConfig, get_peft_model

    base = copy.deepcopy(pretrained)
    frozen = copy.deepcopy(pretrained)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["inp", "blocks.0"]))
    sampler = FlowSampler(num_steps=6)
    batch, cond, _ = _rollout(model, sampler)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    grpo = FlowGRPO(model, sampler, opt, FlowGRPOConfig(clip_range=0.2, beta=0.1), "adapter")
    adv = flow_advantages(right_side_reward(batch["images"]), cond.tolist())
    first = grpo.update(batch, adv)
    assert first["actor/kl_loss"] == 0.0  # LoRA starts as the identity: policy == reference
    second = grpo.update(batch, adv)
    assert second["actor/kl_loss"] > 0
    x, t = batch["latents"][:, 1], batch["timesteps"][:, 1]
    with torch.no_grad():
        with model.disable_adapter():
            ref_v = model(x, t, batch["cond"])
        policy_v = model(x, t, batch["cond"])
        assert torch.allclose(ref_v, frozen(x, t, batch["cond"]), atol=1e-6)
        assert not torch.allclose(policy_v, ref_v, atol=1e-4)
    with pytest.raises(ValueError, match="needs a reference"):
        FlowGRPO(model, sampler, opt, FlowGRPOConfig(beta=0.1))


def test_grpo_moves_the_toys_mass_to_the_rewarded_side(pretrained):
    """Half of the pre-trained toy's points land at x > 0; 30 Flow-GRPO steps of 16 prompts x
    8 samples (a few seconds) move at least 90% there (deterministic ODE samples, held-out
    noise); the figures are in docs/flow.md."""
    model = copy.deepcopy(pretrained)
    sampler = FlowSampler(num_steps=10, noise_level=0.7, reduce="sum")
    ode = FlowSampler(num_steps=10, noise_level=0.0)
    held_out = torch.randn(512, 2, generator=torch.Generator().manual_seed(5))
    eval_cond = torch.arange(4).repeat_interleave(128)

    def right_fraction():
        return right_side_reward(ode.sample(model, eval_cond, held_out)["images"]).mean().item()

    before = right_fraction()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grpo = FlowGRPO(model, sampler, opt, FlowGRPOConfig(clip_range=0.2))
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        cond = torch.randint(4, (16,), generator=gen).repeat_interleave(8)
        batch = sampler.sample(model, cond, torch.randn(128, 2, generator=gen), generator=gen)
        grpo.update(batch, flow_advantages(right_side_reward(batch["images"]), cond.tolist()))
    after = right_fraction()
    assert 0.4 < before < 0.6 and after >= 0.9, (before, after)


@pytest.mark.gpu
def test_the_update_runs_on_a_gpu_like_on_the_cpu(pretrained):
    """Rollout and update with the model and every tensor on the GPU (the update's own
    bookkeeping once mixed a CPU row index into CUDA tensors), with CFG and four shuffled
    mini-batches: the weights end as the same update's on the CPU."""
    sampler = FlowSampler(num_steps=6, sde_steps=3, guidance_scale=2.0)
    config = FlowGRPOConfig(clip_range=1e-2, mini_batch_size=16, micro_batch_size=8)
    out = {}
    for device in ("cpu", "cuda"):
        model = copy.deepcopy(pretrained).to(device)
        grpo = FlowGRPO(model, sampler, torch.optim.SGD(model.parameters(), lr=0.1), config)
        batch, _, un = _rollout(pretrained, sampler, uncond=True)
        batch, un = batch.to(device), un.to(device)
        adv = torch.linspace(-1, 1, len(batch), device=device)
        metrics = grpo.update(batch, adv, uncond=un, generator=torch.Generator().manual_seed(0))
        assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
        out[device] = [p.detach().cpu() for p in model.parameters()]
    for cpu, gpu in zip(out["cpu"], out["cuda"], strict=True):
        torch.testing.assert_close(gpu, cpu, atol=1e-4, rtol=1e-3)
