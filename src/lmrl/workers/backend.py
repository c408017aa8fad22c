"""``trainer.backend=ray``: the cluster and the worker groups of a run, behind the local
workers' faces.

One group of ``resources.nnodes * resources.n_gpus_per_node`` ranks holds, colocated as verl
does by default, the actor with its rollout engine and reference, the reward scoring and (for
PPO) the critic; with ``resources.critic_workers > 0`` the critic gets a pool of its own. An
async run (``async_training.enable``) generates and scores on a rollout group of its own
(``resources.rollout_workers`` ranks, each with a frozen copy of the policy that the trainer's
weights are handed to), so generation overlaps the actor's update.
``build_run`` hands the stand-ins (``actor``, ``critic``, ``reference``, ``engine``,
``reward``) to the trainer, whose step does not change; ``close`` stops the groups and the
Ray instance the run started (never a cluster it only joined).
"""

from __future__ import annotations

import logging

from lmrl.config import Config
from lmrl.workers.group import RayWorkerGroup
from lmrl.workers.plan import WorkerPlan
from lmrl.workers.stand_ins import (
    GroupActor,
    GroupCritic,
    GroupEngine,
    GroupReference,
    GroupReward,
)

log = logging.getLogger("lmrl.workers")

__all__ = ["RayBackend"]


class RayBackend:
    """Start Ray and the worker groups of a run.

    Args:
        cfg: the resolved config (``resources`` places the workers).
        total_steps: training steps, for the learning-rate schedules.

    Raises:
        lmrl.errors.LmrlError: Ray missing, the cluster too small, or a worker failing to
            start (everything started so far is stopped first).
    """

    def __init__(self, cfg: Config, plan: WorkerPlan, total_steps: int) -> None:
        from lmrl.workers.ray_cluster import RayCluster

        rollout = cfg.resources.rollout_workers if plan.separate_rollout else 0
        self.cluster = RayCluster(cfg.resources, device=cfg.trainer.device, extra_workers=rollout)
        self.groups: list[RayWorkerGroup] = []
        self.cluster.start()
        try:
            self._start(cfg, plan, total_steps)
        except BaseException:
            self.close()
            raise

    def _start(self, cfg: Config, plan: WorkerPlan, total_steps: int) -> None:
        r = cfg.resources
        use_gpu = self.cluster.use_gpu
        world = r.nnodes * r.n_gpus_per_node
        separate_critic, separate_rollout = plan.separate_critic, plan.separate_rollout
        roles = ["actor"] if separate_rollout else ["actor", "reward"]
        if plan.critic and not separate_critic:
            roles.append("critic")
        main = RayWorkerGroup("actor", self.cluster, cfg, plan, roles, world, use_gpu, total_steps)
        self.groups.append(main)
        critic_group = main
        if separate_critic:
            critic_group = RayWorkerGroup(
                "critic",
                self.cluster,
                cfg,
                plan,
                ["critic"],
                r.critic_workers,
                use_gpu,
                total_steps,
            )
            self.groups.append(critic_group)
        rollout_group = main
        if separate_rollout:
            rollout_group = RayWorkerGroup(  # scoring one batch while the next one generates
                "rollout", self.cluster, cfg, plan, ["rollout", "reward"], r.rollout_workers,
                use_gpu, total_steps, concurrency=2,
            )  # fmt: skip
            self.groups.append(rollout_group)
        parts = set(main.infos[0]["parts"]) | set(critic_group.infos[0]["parts"])
        self.actor = GroupActor(main)
        self.engine = GroupEngine(rollout_group)
        self.reward = GroupReward(rollout_group)
        self.reference = GroupReference(main) if "reference" in parts else None
        self.critic = GroupCritic(critic_group) if "critic" in parts else None
        log.info(
            "ray: %d %s workers (%s)%s%s", world, "GPU" if use_gpu else "CPU",
            ", ".join(roles),
            f"; critic pool of {r.critic_workers}" if separate_critic else "",
            f"; rollout group of {r.rollout_workers}" if separate_rollout else "",
        )  # fmt: skip

    def close(self) -> None:
        """Stop the groups, then the Ray instance this run started (safe to call twice)."""
        groups, self.groups = self.groups, []
        for group in groups:
            group.close()
        self.cluster.stop()
