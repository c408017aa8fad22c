"""The actor worker: micro-batch invariance of the update, the old-log-probs flag, the loss
mask, the full KL against a reference model, and each loss getting exactly its own
hyperparameters."""

from __future__ import annotations

import pytest
import torch
from tests.host_reads import HostReads

from lmrl.algos import agg_loss, policy_losses
from lmrl.algos.losses import loss_hyperparameters
from lmrl.config import ActorConfig, OptimConfig
from lmrl.models import Reference, apply_lora, build_reference, freeze, load_causal_lm
from lmrl.models.tiny import build_tiny_model
from lmrl.workers import actor as actor_module
from lmrl.workers.actor import UPDATE_KEYS, policy_loss_kwargs

METRICS = ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
           "actor/ppo_kl")  # fmt: skip


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """A second tiny model (another seed): a reference that differs from the policy."""
    return build_tiny_model(tmp_path_factory.mktemp("other"), arch="qwen2", size="tiny", seed=1)


def _policy(tiny_dir):
    return load_causal_lm(tiny_dir).double()


def _other_reference(other_dir):
    return Reference(freeze(load_causal_lm(other_dir).double()))


# ------------------------------------------------------------------ micro-batch invariance


@pytest.mark.parametrize(
    "overrides",
    [
        {"loss_agg_mode": "token-mean", "use_kl_loss": True, "entropy_coeff": 0.01},
        {"loss_agg_mode": "seq-mean-token-mean", "use_kl_loss": True, "kl_loss_type": "full"},
        {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_mode": "gspo"},
    ],
    ids=["token-mean+k3+entropy", "seq-mean+full-kl", "gspo"],
)
def test_the_update_does_not_depend_on_the_micro_batch_size(
    tiny_dir, other_dir, batch_factory, with_log_probs, actor_factory, step_grads, grads_close,
    overrides,
):  # fmt: skip
    steps = step_grads(actor_module)
    metrics = []
    for micro in (None, 1, 4):  # the whole mini-batch, one row, and a size that does not divide
        worker = actor_factory(
            _policy(tiny_dir), _other_reference(other_dir), ppo_micro_batch_size=micro,
            **overrides,
        )  # fmt: skip
        batch = with_log_probs(batch_factory(), worker)
        metrics.append(worker.update_actor(batch))
    assert len(steps) == 3
    for i in (1, 2):
        # the shared-prompt forward (micro-batches holding a whole group) agrees with the
        # row-by-row one to ~1e-7 of the largest gradient entry in float64
        grads_close(steps[i], steps[0], tol=1e-5)
        for key in (*METRICS, *(["actor/kl_loss"] if "use_kl_loss" in overrides else [])):
            torch.testing.assert_close(metrics[i][key], metrics[0][key], rtol=1e-6, atol=1e-9)


def test_the_entropy_metric_is_per_token_whatever_the_aggregation(
    tiny_dir, batch_factory, with_log_probs, actor_factory
):
    # the loss term under seq-mean-token-sum-norm sums over sequences (Dr.GRPO's constant
    # divisor); the metric stays the token mean, so 2 modes x 2 micro sizes agree
    values = []
    for mode in ("token-mean", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        for micro in (None, 1):
            worker = actor_factory(
                _policy(tiny_dir), loss_agg_mode=mode, ppo_micro_batch_size=micro
            )
            batch = with_log_probs(batch_factory(), worker)
            values.append(float(worker.update_actor(batch)["actor/entropy"]))
    assert max(values) - min(values) < 1e-9
    assert 0 < values[0] < 6  # nats per token, below log(259)


# ------------------------------------------------------------------ old log-probs flag


def test_old_log_probs_from_update_are_this_pass_own(
    tiny_dir, batch_factory, actor_factory, step_grads, grads_close
):
    steps = step_grads(actor_module)
    metrics = []
    for mode in ("given", "flag", "flag ignores the key"):
        worker = actor_factory(_policy(tiny_dir))
        batch = batch_factory()
        if mode == "given":
            batch["old_log_probs"], _ = worker.compute_log_probs(batch)
        elif mode == "flag ignores the key":
            batch["old_log_probs"] = torch.full(batch["responses"].shape, -9.0)
        metrics.append(worker.update_actor(batch, old_log_probs_from_update=mode != "given"))
    grads_close(steps[1], steps[0], tol=1e-9)
    grads_close(steps[2], steps[1], tol=0.0)
    for m in metrics[1:]:
        assert m["actor/ppo_kl"] == 0 and m["actor/pg_clipfrac"] == 0  # ratio exactly 1


def test_old_log_probs_missing_without_the_flag_is_an_error(tiny_dir, batch_factory, actor_factory):
    worker = actor_factory(_policy(tiny_dir))
    with pytest.raises(ValueError, match="old_log_probs_from_update=True"):
        worker.update_actor(batch_factory())


@pytest.mark.parametrize("overrides", [{"ppo_epochs": 2}, {"ppo_mini_batch_size": 1}])
def test_the_flag_needs_one_epoch_of_one_mini_batch(
    tiny_dir, batch_factory, actor_factory, overrides
):
    worker = actor_factory(_policy(tiny_dir), **overrides)
    with pytest.raises(ValueError, match="one epoch of one mini-batch"):
        worker.update_actor(batch_factory(), old_log_probs_from_update=True)


# ------------------------------------------------------------------ loss_mask


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_loss_mask_trains_as_a_narrower_response_mask(
    tiny_dir, batch_factory, with_log_probs, actor_factory, step_grads, grads_close,
    loss_agg_mode,
):  # fmt: skip
    assert "loss_mask" in UPDATE_KEYS
    settings = {"loss_agg_mode": loss_agg_mode, "use_kl_loss": True, "entropy_coeff": 0.01}
    base = with_log_probs(batch_factory(), actor_factory(_policy(tiny_dir)))
    loss_mask = base["response_mask"].clone()
    loss_mask[0, 1] = loss_mask[4, 3] = False  # two tokens
    loss_mask[3] = False  # a whole sequence (its one token)
    steps = step_grads(actor_module)
    metrics = []
    for mode in ("loss_mask", "narrower response_mask", "neither"):
        batch = base.select(*base.keys())
        if mode == "loss_mask":
            batch["loss_mask"] = loss_mask
        elif mode == "narrower response_mask":
            batch["response_mask"] = loss_mask
        metrics.append(actor_factory(_policy(tiny_dir), **settings).update_actor(batch))
    grads_close(steps[0], steps[1], tol=1e-12)
    for key in (*METRICS, "actor/kl_loss"):
        torch.testing.assert_close(metrics[0][key], metrics[1][key], rtol=1e-12, atol=0)
    first = next(iter(steps[0]))
    assert not torch.allclose(steps[2][first], steps[0][first])  # the mask mattered


def test_a_bad_loss_mask_is_an_error(tiny_dir, batch_factory, with_log_probs, actor_factory):
    worker = actor_factory(_policy(tiny_dir))
    batch = with_log_probs(batch_factory(), worker)
    batch["loss_mask"] = torch.ones_like(batch["response_mask"])  # True on padding too
    with pytest.raises(ValueError, match="subset"):
        worker.update_actor(batch)
    batch["loss_mask"] = batch["response_mask"].float()
    with pytest.raises(ValueError, match="bool"):
        worker.update_actor(batch)


# ------------------------------------------------------------------ full KL


def test_the_full_kl_needs_a_reference(tiny_dir, actor_factory):
    with pytest.raises(ValueError, match="reference="):
        actor_factory(_policy(tiny_dir), use_kl_loss=True, kl_loss_type="full")
    actor_factory(_policy(tiny_dir), kl_loss_type="full")  # no KL loss: nothing to need


@pytest.mark.parametrize("kind", ["frozen", "lora"])
def test_full_kl_is_zero_against_the_initial_policy_then_grows(
    tiny_dir, batch_factory, actor_factory, kind
):
    policy = load_causal_lm(tiny_dir)
    if kind == "lora":
        policy = apply_lora(policy, 4, 8)
    worker = actor_factory(
        policy, build_reference(policy), use_kl_loss=True, kl_loss_type="full", kl_loss_coef=0.1,
        optim=OptimConfig(lr=1e-2, weight_decay=0.0),
    )  # fmt: skip
    batch = batch_factory()  # no ref_log_probs: the full KL runs the reference itself
    first = worker.update_actor(batch, old_log_probs_from_update=True)
    assert abs(float(first["actor/kl_loss"])) < 1e-6
    second = worker.update_actor(batch, old_log_probs_from_update=True)
    assert float(second["actor/kl_loss"]) > 1e-6
    assert torch.isfinite(second["actor/grad_norm"])


def test_full_kl_gradient_equals_the_unchunked_kl_gradient(
    tiny_dir, other_dir, batch_factory, actor_factory, step_grads, grads_close
):
    # advantages 0 and no entropy term: the update's gradient is the KL loss's alone
    batch = batch_factory()
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    steps = step_grads(actor_module)
    worker = actor_factory(
        _policy(tiny_dir), _other_reference(other_dir), use_kl_loss=True, kl_loss_type="full",
        kl_loss_coef=1.0, ppo_micro_batch_size=4,
    )  # fmt: skip
    metrics = worker.update_actor(batch, old_log_probs_from_update=True)

    policy, reference = _policy(tiny_dir), _other_reference(other_dir)
    T = batch["responses"].shape[1]
    inputs = {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"].long(),
        "position_ids": batch["position_ids"],
    }
    with torch.no_grad():
        ref_logits = reference.model(**inputs).logits[:, -T - 1 : -1]
    log_p = torch.log_softmax(policy(**inputs).logits[:, -T - 1 : -1] / 0.8, -1)
    log_q = torch.log_softmax(ref_logits / 0.8, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    kl_loss = agg_loss(kl, batch["response_mask"], "token-mean")
    kl_loss.backward()
    want = {i: p.grad for i, p in enumerate(p for p in policy.parameters() if p.requires_grad)}
    kl_value = float(kl_loss.detach())
    assert float(metrics["actor/kl_loss"]) == pytest.approx(kl_value, rel=1e-6)  # a fp32 metric
    grads_close(steps[0], want, tol=1e-5)


# ------------------------------------------------------------------ loss hyperparameters


@pytest.mark.parametrize("name", policy_losses.names())
def test_each_loss_gets_exactly_its_own_hyperparameters(
    tiny_dir, batch_factory, with_log_probs, actor_factory, name
):
    worker = actor_factory(
        load_causal_lm(tiny_dir), loss_mode=name, clip_ratio_high=0.28, tau_pos=0.9
    )
    assert tuple(worker.loss_kwargs) == loss_hyperparameters(name)
    expected = {"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": 0.28,
                "clip_ratio_c": 3.0, "tau_pos": 0.9, "tau_neg": 1.05, "clip_cov_ratio": 0.0002,
                "clip_cov_lb": 1.0, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.0002,
                "ppo_kl_coef": 1.0}  # fmt: skip
    assert worker.loss_kwargs == {k: expected[k] for k in loss_hyperparameters(name)}
    metrics = worker.update_actor(with_log_probs(batch_factory(), worker))  # no TypeError
    assert all(torch.isfinite(v) for v in metrics.values())


def test_a_hyperparameter_the_config_lacks_is_named(monkeypatch, actor_factory, tiny_dir):
    monkeypatch.setattr(
        actor_module, "loss_hyperparameters", lambda name: ("clip_ratio", "clip_ratio_mid")
    )
    with pytest.raises(ValueError, match="clip_ratio_mid"):
        actor_factory(load_causal_lm(tiny_dir))


def test_policy_loss_kwargs_of_reinforce_is_empty():
    cfg = ActorConfig(policy_loss={"loss_mode": "reinforce"})
    assert policy_loss_kwargs(cfg) == {}


# ------------------------------------------------------------------ no host reads per micro


@pytest.mark.parametrize("overrides", [
    {"use_kl_loss": True, "entropy_coeff": 0.01},
    {"use_kl_loss": True, "kl_loss_type": "full", "loss_agg_mode": "seq-mean-token-mean"},
    {"loss_mode": "gspo", "loss_agg_mode": "seq-mean-token-sum-norm"},
], ids=["k3+entropy", "full-kl", "gspo"])  # fmt: skip
def test_a_micro_batch_of_the_update_reads_nothing_back(
    tiny_dir, other_dir, batch_factory, with_log_probs, actor_factory, monkeypatch, overrides
):
    """Each micro-batch's forward, loss and backward queue work without reading the device
    back (on a GPU the host stays ahead of it): the layout of the rows is read once, before."""
    worker = actor_factory(
        _policy(tiny_dir), _other_reference(other_dir), ppo_micro_batch_size=2, **overrides
    )
    batch = with_log_probs(batch_factory(), worker)
    reads, micro_step = HostReads(), worker._micro_step

    def watched(*args, **kwargs):
        with reads:
            micro_step(*args, **kwargs)

    monkeypatch.setattr(worker, "_micro_step", watched)
    worker.update_actor(batch)
    assert reads.reads == []
    monkeypatch.setattr(actor_module, "with_row_layout", lambda batch: batch)  # the check sees
    worker.update_actor(batch)
    assert any("trim_batch" in where for _, where in reads.reads)
