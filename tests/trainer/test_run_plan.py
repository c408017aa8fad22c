"""The run's plan against the run: the stages ``lmrl plan`` lists are the stages a step runs.

For each config of the table (every advantage estimator, KL in the reward and in the loss,
the full KL, LoRA, the critic's warm-up, async, the three scoring overlaps, the three log-prob
modes, DAPO's dynamic sampling, a rollout in its own dtype), a real tiny run is built from the
config and stepped (twice where the second step differs: the critic's warm-up, async); every
stage the step starts (``Trainer(on_stage=...)``) is recorded
and compared with `RunPlan.stages` for that step, and with the phases of ``lmrl plan``'s
memory plan, which is made from the same `RunPlan` and the model's ``config.json`` alone.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
from tests.trainer.conftest import _tiny_overrides, linked_workspace

from lmrl.config import load_config
from lmrl.trainer import Trainer, build_run
from lmrl.trainer.memory_plan import plan_memory
from lmrl.trainer.plan import STAGES, RunPlan

# the memory plan's phase of each stage that holds memory of its own
PHASE = {
    "gen": "rollout",
    "old_log_prob": "old log-probs",
    "ref": "ref",
    "values": "critic update",
    "update_critic": "critic update",
    "update_actor": "actor update",
}
KL_LOSS = ("actor.use_kl_loss=true", "actor.kl_loss_type=low_var_kl")
TWO_EPOCHS = ("actor.ppo_epochs=2",)  # the old log-probs are a stage of their own

CASES = {
    "grpo": (),
    "grpo two epochs": TWO_EPOCHS,
    "grpo_passk": ("algorithm.adv_estimator=grpo_passk",),
    "opo": ("algorithm.adv_estimator=opo",),
    "rloo": ("algorithm.adv_estimator=rloo",),
    "remax": ("algorithm.adv_estimator=remax",),
    "reinforce_plus_plus": ("algorithm.adv_estimator=reinforce_plus_plus",),
    "reinforce_plus_plus_baseline": ("algorithm.adv_estimator=reinforce_plus_plus_baseline",),
    "gae": ("algorithm.adv_estimator=gae",),
    "gae critic warm-up": ("algorithm.adv_estimator=gae", "trainer.critic_warmup=1"),
    "kl in reward": ("algorithm.use_kl_in_reward=true",),
    "kl loss": KL_LOSS,
    "full kl": ("actor.use_kl_loss=true", "actor.kl_loss_type=full"),
    "full kl and kl in reward": (
        "actor.use_kl_loss=true", "actor.kl_loss_type=full", "algorithm.use_kl_in_reward=true",
    ),
    "lora": ("model.lora_rank=4",),
    "lora kl loss": ("model.lora_rank=4", *KL_LOSS),
    "lora full kl": ("model.lora_rank=4", "actor.use_kl_loss=true", "actor.kl_loss_type=full"),
    "bypass": ("rollout.log_prob_mode=bypass",),
    "rollout correction": ("rollout.log_prob_mode=rollout_correction",),
    "rollout dtype": ("rollout.dtype=bfloat16",),
    "scoring rows": ("reward.overlap.rows=true",),
    "scoring chunks": ("reward.overlap.chunks=2", *TWO_EPOCHS),
    "scoring with the log-probs": ("reward.overlap.log_probs=true", *TWO_EPOCHS, *KL_LOSS),
    "async": ("async_training.enable=true", "async_training.staleness_threshold=1"),
    "async decoupled": (
        "async_training.enable=true", "rollout.log_prob_mode=decoupled", "algorithm.adv_estimator=gae",
    ),
    "dapo": ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=4"),
}  # fmt: skip


@pytest.fixture(scope="module")
def workspace(tiny_workspace, tmp_path_factory):
    return linked_workspace(tiny_workspace, tmp_path_factory.mktemp("plan-table"))


def run_config(workspace, run_dir, extra):
    overrides = _tiny_overrides(workspace, run_dir, *extra)
    overrides = [o for o in overrides if not o.startswith("trainer.save_freq")]
    return load_config(None, [*overrides, "trainer.save_freq=-1"])


@pytest.mark.parametrize("case", list(CASES))
def test_the_plan_lists_the_stages_the_run_executes(workspace, tmp_path, case):
    cfg = run_config(workspace, tmp_path / "run", CASES[case])
    plan = RunPlan.from_config(cfg)  # what `lmrl plan` makes, before anything loads
    memory = plan_memory(plan)
    parts = build_run(cfg)
    assert parts.plan == dataclasses.replace(plan, estimator=parts.plan.estimator)
    # the parts are the ones the plan names
    w = plan.workers
    assert (parts.reference is not None) == w.ref_stage
    assert (parts.critic is not None) == w.critic
    assert parts.actor.full_kl == w.ref_in_update
    assert parts.engine.shares_weights == plan.engine_shares_weights
    assert parts.engine.reports_rows or not plan.reward_rows
    assert (parts.kl_ctrl is not None) == plan.kl_in_reward
    if w.reference != "none":
        lora = w.reference == "adapter_off"
        assert cfg.model.lora_rank > 0 if lora else cfg.model.lora_rank == 0

    seen: list[str] = []  # the stages the step runs, in the trainer's thread
    ahead: set[str] = set()  # under async, what runs ahead in threads of its own

    def record(name: str) -> None:
        main = threading.current_thread() is threading.main_thread()
        seen.append(name) if main else ahead.add(name)

    trainer = Trainer(parts, cfg.trainer, on_stage=record)
    try:
        for step in range(2 if plan.critic_warmup or plan.asynchronous else 1):
            seen.clear()
            trainer.step()
            ran = {name for name in seen if name in STAGES}
            rows = len(trainer.last_batch)
            listed = set(plan.stages(step, rows))
            assert ran == listed, f"step {step}: ran {sorted(ran)}, planned {sorted(listed)}"
    finally:
        trainer.close()
    if plan.asynchronous:
        assert set(plan.generation_stages) <= ahead <= {*plan.generation_stages, "ahead"}
    # lmrl plan's phases are the memory-holding stages of the first step that updates the
    # actor, with a full batch
    final = tuple(dict.fromkeys(plan.generation_stages + plan.stages(plan.critic_warmup)))
    assert [p.name for p in memory.phases] == list(
        dict.fromkeys(PHASE[s] for s in final if s in PHASE)
    )
    assert memory.settings["stages"] == list(final)


def test_every_estimator_is_in_the_table():
    from lmrl.algos import advantage_estimators

    named = {o.split("=")[1] for extra in CASES.values() for o in extra if "adv_estimator" in o}
    assert set(advantage_estimators.names()) <= named | {"grpo"}


def test_the_plan_reads_the_reference_from_the_registry_not_the_name(workspace, tmp_path):
    """The full KL's reference runs inside the update because the KL registry says the
    estimator needs logits; no stage computes ref_log_probs for it."""
    plan = RunPlan.from_config(
        run_config(workspace, tmp_path, ("actor.use_kl_loss=true", "actor.kl_loss_type=full"))
    )
    assert plan.workers.ref_in_update and not plan.workers.ref_stage
    assert plan.reference == "frozen copy, inside the update"
    assert "ref" not in plan.stages()
