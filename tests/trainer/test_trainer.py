"""The trainer step end to end on a tiny model: every algorithm of the recipes, a few steps
each; micro-batch invariance of the update; config errors from the command line."""

from __future__ import annotations

import copy
import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from lmrl.cli import main as cli_main
from lmrl.config import load_config
from lmrl.data.tasks import write_task
from lmrl.models import build_tiny_model
from lmrl.trainer import Trainer, build_run
from lmrl.trainer.stages import concat_rollouts

from .conftest import trainable_state

# A reward with spread inside every group, so that every estimator has signal: the share of
# digits in the response, plus a little for its length.
REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if not solution_str:
        return 0.0
    digits = sum(ch.isdigit() for ch in solution_str)
    return digits / len(solution_str) + 0.01 * len(solution_str)
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trainer")
    build_tiny_model(root / "model", arch="qwen2", size="tiny", seed=0)
    write_task("digits", root / "data", seed=0, num_train=32, num_test=8)
    (root / "reward.py").write_text(REWARD_FILE)
    return root


def base_overrides(root: Path, run: str) -> list[str]:
    return [
        f"model.path={root / 'model'}",
        f"data.train_files={root / 'data' / 'train.parquet'}",
        "data.max_prompt_length=64",
        "data.max_response_length=8",
        "data.train_batch_size=4",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size=4",
        "actor.optim.lr=1e-2",
        "actor.optim.weight_decay=0",
        "critic.optim.lr=1e-2",
        "critic.optim.weight_decay=0",
        "model.enable_gradient_checkpointing=false",
        "trainer.total_training_steps=2",
        "trainer.device=cpu",
        f"trainer.default_local_dir={root / run}",
        "reward.num_workers=0",
        f"reward.custom_reward_function.path={root / 'reward.py'}",
    ]


RECIPES = {
    "grpo": ["algorithm.adv_estimator=grpo"],
    "ppo_gae_critic": ["algorithm.adv_estimator=gae", "algorithm.gamma=0.99", "algorithm.lam=0.95"],
    "dr_grpo": [
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=false",
        "actor.loss_agg_mode=seq-mean-token-sum-norm",
    ],
    "dapo": [
        "algorithm.adv_estimator=grpo",
        "actor.clip_ratio_low=0.2",
        "actor.clip_ratio_high=0.28",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=seq_reward",
        "algorithm.filter_groups.max_num_gen_batches=4",
        "reward.manager=dapo",
        "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=4",
        "reward.overlong_buffer.penalty_factor=1.0",
    ],
    "gspo": [
        "algorithm.adv_estimator=grpo",
        "actor.policy_loss.loss_mode=gspo",
        "actor.clip_ratio_low=3e-4",
        "actor.clip_ratio_high=4e-4",
        "actor.loss_agg_mode=seq-mean-token-mean",
    ],
    "gmpo": ["algorithm.adv_estimator=grpo", "actor.policy_loss.loss_mode=geo_mean"],
    "cispo": ["algorithm.adv_estimator=grpo", "actor.policy_loss.loss_mode=cispo"],
    "sapo": ["algorithm.adv_estimator=grpo", "actor.policy_loss.loss_mode=sapo"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_pp": ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=0.99"],
    "reinforce_pp_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    "remax": ["algorithm.adv_estimator=remax"],
    "passk": ["algorithm.adv_estimator=grpo_passk"],
    "opo": ["algorithm.adv_estimator=opo"],
    "lora": [
        "algorithm.adv_estimator=grpo",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "actor.use_kl_loss=true",
    ],
    "bypass": ["algorithm.adv_estimator=grpo", "rollout.log_prob_mode=bypass"],
    "rollout_correction": [
        "algorithm.adv_estimator=grpo",
        "rollout.log_prob_mode=rollout_correction",
        "rollout.correction.level=sequence",
        "rollout.correction.mode=truncate",
    ],
    "kl_in_reward_adaptive": [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_penalty=low_var_kl",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.05",
        "algorithm.kl_ctrl.target_kl=0.01",
        "algorithm.kl_ctrl.horizon=100",
    ],
    "kl_loss": [
        "algorithm.adv_estimator=grpo",
        "actor.use_kl_loss=true",
        "actor.kl_loss_type=low_var_kl",
        "actor.kl_loss_coef=0.1",
        "actor.entropy_coeff=0.01",
    ],
}


def make_trainer(cfg) -> Trainer:
    return Trainer(build_run(cfg), cfg.trainer)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_trains_every_parameter_with_finite_metrics(workspace, recipe):
    cfg = load_config(None, base_overrides(workspace, f"run_{recipe}") + RECIPES[recipe])
    trainer = make_trainer(cfg)
    before = trainable_state(trainer)
    history = trainer.fit()
    after = trainable_state(trainer)

    assert len(history) == 2
    unchanged = [name for name, p in before.items() if torch.equal(p, after[name])]
    assert not unchanged, f"parameters that did not change: {unchanged[:5]}"
    for metrics in history:
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, bad
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean",
                    "critic/advantages/mean", "response_length/mean", "timing_s/gen"):  # fmt: skip
            assert key in metrics, key
    assert (workspace / f"run_{recipe}" / "config.yaml").exists()
    assert (workspace / f"run_{recipe}" / "metrics.jsonl").read_text().count("\n") == 2

    last = history[-1]
    if trainer.parts.critic is not None:
        assert {"critic/vf_loss", "critic/vf_explained_var", "critic/values/mean"} <= last.keys()
    if cfg.algorithm.use_kl_in_reward:
        coef = [m["actor/reward_kl_penalty_coeff"] for m in history]
        assert coef[0] == pytest.approx(0.05)  # the adaptive controller moves after a step
    if cfg.actor.use_kl_loss:
        assert "actor/kl_loss" in last
    if cfg.rollout.log_prob_mode == "rollout_correction":
        assert "rollout_corr/is_eff_sample_size" in last
    if cfg.algorithm.filter_groups["enable"]:
        assert last["filter_groups/gen_batches"] >= 1
        assert "reward/overlong_penalty/mean" in last


def test_old_log_probs_skipped_only_when_provably_identical(workspace):
    one_mini = load_config(
        None,
        [
            *base_overrides(workspace, "run_skip"),
            "algorithm.adv_estimator=grpo",
            "actor.ppo_mini_batch_size=4",
        ],
    )
    metrics = make_trainer(one_mini).step()
    assert metrics["actor/old_log_prob_recomputed"] == 0.0
    assert "timing_s/old_log_prob" not in metrics
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)  # ratio 1 on every token

    two_minis = load_config(
        None, [*base_overrides(workspace, "run_noskip"), "algorithm.adv_estimator=grpo"]
    )
    metrics = make_trainer(two_minis).step()
    assert metrics["actor/old_log_prob_recomputed"] == 1.0


def test_micro_batch_invariance_of_the_actor_update(workspace):
    """1 vs 4 micro-batches: the same accumulated gradient, the same update (1e-5)."""
    cfg = load_config(
        None, [*base_overrides(workspace, "run_micro"), "algorithm.adv_estimator=grpo"]
    )
    trainer = make_trainer(cfg)
    prompts = trainer.parts.train_data.get_batch(list(range(4)))
    batch = trainer.parts.engine.generate(prompts, 4, trainer.parts.plan.sampling)
    batch["old_log_probs"], _ = trainer.parts.actor.compute_log_probs(batch)
    batch["old_log_probs"] = batch["old_log_probs"] + 0.05 * torch.randn_like(
        batch["old_log_probs"]
    )
    batch["advantages"] = torch.randn_like(batch["old_log_probs"]) * batch["response_mask"]

    results = []
    for micro in (16, 4):
        worker_cfg = copy.deepcopy(cfg.actor)
        worker_cfg.ppo_mini_batch_size = 4
        worker_cfg.ppo_micro_batch_size = micro
        model = copy.deepcopy(trainer.parts.actor.model)
        worker = type(trainer.parts.actor)(
            model, worker_cfg, rollout_n=4, max_response_length=8, temperature=1.0,
            log_prob_micro_batch_size=None, total_steps=2, seed=0,
        )  # fmt: skip
        worker._accumulate(batch, micro)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        worker.optimizer.zero_grad()
        worker.update_actor(batch)
        results.append((grads, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (grads_a, params_a), (grads_b, params_b) = results
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-6, rtol=1e-5)
    for name in params_a:
        # Adam's first step moves a weight by lr * g / (|g| + eps): where |g| is near eps
        # (1e-8), a 1e-10 rounding difference in g changes that step by ~5e-5 (lr = 0.01),
        # so those weights are compared through their gradients above, not their updates.
        conditioned = grads_a[name].abs() > 1e-6 if name in grads_a else slice(None)
        torch.testing.assert_close(
            params_a[name][conditioned], params_b[name][conditioned], atol=1e-5, rtol=0
        )


def test_concat_rollouts_aligns_widths(workspace):
    cfg = load_config(
        None, [*base_overrides(workspace, "run_concat"), "algorithm.adv_estimator=grpo"]
    )
    trainer = make_trainer(cfg)
    short = trainer.parts.train_data.get_batch([0, 1])
    first = trainer.parts.engine.generate(short, 2, trainer.parts.plan.sampling)
    short_sampling = type(trainer.parts.plan.sampling)(max_new_tokens=3, temperature=1.0)
    second = trainer.parts.engine.generate(
        trainer.parts.train_data.get_batch([2]), 2, short_sampling
    )
    both = concat_rollouts([first, second], trainer.parts.engine.pad_id)
    assert len(both) == 6
    width_t = max(first["responses"].shape[1], second["responses"].shape[1])
    assert both["responses"].shape[1] == width_t
    assert torch.equal(both["input_ids"], torch.cat([both["prompts"], both["responses"]], 1))
    # the second batch's rows keep their tokens and masks, padded on the right
    t2 = second["responses"].shape[1]
    assert torch.equal(both["responses"][4:, :t2], second["responses"])
    assert not both["response_mask"][4:, t2:].any()
    # recomputed log-probs do not depend on the padding
    lp_both, _ = trainer.parts.actor.compute_log_probs(both)
    lp_second, _ = trainer.parts.actor.compute_log_probs(second)
    torch.testing.assert_close(lp_both[4:, :t2], lp_second, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- CLI errors


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor.clip_ratoi=0.2"], "did you mean 'actor.clip_ratio'"),
        (["actor.clip_ratio=abc"], "actor.clip_ratio"),
        (["algorithm.adv_estimator=grpoo"], "algorithm.adv_estimator"),
        (["actor.policy_loss.loss_mode=ppo2"], "actor.policy_loss.loss_mode"),
        (["data.train_batch_size=6", "actor.ppo_mini_batch_size=4"], "ppo_mini_batch_size"),
        (["actor.clip_ratio_c=0.5"], "clip_ratio_c"),
    ],
)
def test_config_errors_on_the_command_line(workspace, capsys, overrides, message):
    code = cli_main(["train", *base_overrides(workspace, "run_err"), *overrides])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def seed_command_line(workspace: Path) -> list[str]:
    """Seed 002 §5.3's PPO command line with a local tiny model and local parquet files."""
    return textwrap.dedent(f"""
        data.train_files={workspace}/data/train.parquet
        data.val_files={workspace}/data/test.parquet
        data.train_batch_size=256
        actor_rollout_ref.model.path={workspace}/model
        actor_rollout_ref.actor.ppo_epochs=2
        actor_rollout_ref.actor.ppo_mini_batch_size=64
        actor_rollout_ref.actor.clip_ratio=0.2
        actor_rollout_ref.actor.optim.lr=1e-6
        critic.model.path={workspace}/model
        critic.ppo_epochs=2
        critic.ppo_mini_batch_size=64
        critic.optim.lr=5e-6
        algorithm.adv_estimator=gae
        algorithm.gamma=0.99
        algorithm.lam=0.95
        trainer.total_epochs=3
        trainer.n_gpus_per_node=8
    """).split()


def test_verl_command_line_translates(workspace):
    """Seed 002 §5.3's command line, with local paths, resolves to our keys."""
    cfg = load_config(None, seed_command_line(workspace))
    assert cfg.model.path == f"{workspace}/model"
    assert (cfg.actor.ppo_epochs, cfg.actor.ppo_mini_batch_size, cfg.actor.clip_ratio) == (
        2,
        64,
        0.2,
    )
    assert cfg.critic.enable and cfg.critic.optim.lr == 5e-6
    assert (cfg.algorithm.gamma, cfg.algorithm.lam) == (0.99, 0.95)


@pytest.mark.slow
def test_verl_command_line_runs_as_written(tmp_path, capsys):
    """The same command line, run as written (256 prompts per step, PPO with a critic,
    3 epochs over 256 prompts, 512-token responses) on a tiny model."""
    build_tiny_model(tmp_path / "model", arch="qwen2", size="tiny", seed=0)
    write_task("digits", tmp_path / "data", seed=0, num_train=256, num_test=16)
    run_dir = tmp_path / "run"
    code = cli_main(["train", *seed_command_line(tmp_path), f"trainer.default_local_dir={run_dir}"])
    assert code == 0, capsys.readouterr().err[-2000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [m["step"] for m in steps] == [0, 1, 2, 3]  # validation before training, 3 steps
    assert all(math.isfinite(m["critic/vf_loss"]) for m in steps[1:])
    assert (run_dir / "global_step_3" / "critic.safetensors").exists()


def test_non_finite_loss_skips_the_optimizer_step(workspace):
    cfg = load_config(None, [*base_overrides(workspace, "run_nan"), "algorithm.adv_estimator=grpo"])
    trainer = make_trainer(cfg)
    batch = trainer.parts.engine.generate(
        trainer.parts.train_data.get_batch([0, 1, 2, 3]), 4, trainer.parts.plan.sampling
    )
    batch["old_log_probs"], _ = trainer.parts.actor.compute_log_probs(batch)
    advantages = torch.ones_like(batch["old_log_probs"])
    advantages[0, 0] = float("nan")  # one poisoned token in the first mini-batch
    batch["advantages"] = advantages * batch["response_mask"]
    before = {n: p.detach().clone() for n, p in trainer.parts.actor.model.named_parameters()}
    metrics = trainer.parts.actor.update_actor(batch)
    assert metrics["actor/skipped_steps"] == 1.0  # the other mini-batch still stepped
    changed = [
        n for n, p in trainer.parts.actor.model.named_parameters() if not torch.equal(p, before[n])
    ]
    assert changed
    assert all(torch.isfinite(p).all() for p in trainer.parts.actor.model.parameters())


@pytest.mark.parametrize("lora", [False, True])
def test_a_finished_run_exports_its_policy_as_a_model_path(workspace, lora):
    from lmrl.models import load_causal_lm
    from lmrl.models.forward import compute_log_probs

    extra = ["model.lora_rank=4", "model.lora_alpha=8", "actor.optim.lr=5e-2"] if lora else []
    cfg = load_config(None, [*base_overrides(workspace, f"export-{lora}"), *extra])
    trainer = Trainer(build_run(cfg), cfg.trainer)
    trainer.fit()
    final = Path(cfg.trainer.default_local_dir) / "final"
    assert (final / "config.json").is_file() and (final / "tokenizer.json").is_file()
    exported = load_causal_lm(final, dtype="float32", device="cpu")
    batch = trainer.last_batch
    want, _ = compute_log_probs(trainer.parts.policy, batch, 8, 1.0)
    got, _ = compute_log_probs(exported, batch, 8, 1.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    start = load_causal_lm(workspace / "model", dtype="float32", device="cpu")
    assert not torch.allclose(compute_log_probs(start, batch, 8, 1.0)[0], want, atol=1e-4)
    if not lora:
        assert not (final / "adapter").exists()
        return
    # the adapter in PEFT's own format, loadable on the base model without lmrl
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(start, str(final / "adapter"))
    assert adapted.peft_config["default"].r == 4 and adapted.peft_config["default"].lora_alpha == 8
    got, _ = compute_log_probs(adapted, batch, 8, 1.0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
