"""Run ``lmrl train`` with a fault injected through the trainer's ``on_stage`` seam.

Usage: ``python fault_run.py STAGE@N key=value ...``: the process SIGKILLs itself the N-th
time the stage named STAGE starts (gen, reward, old_log_prob, ref, values, adv,
update_critic, update_actor, and save: a checkpoint's files written, its manifest not yet).
Used by the checkpoint tests to prove exact resume after a hard kill anywhere.
"""

from __future__ import annotations

import os
import signal
import sys


def kill_at(spec: str):
    stage, count = spec.split("@")
    seen = {"n": 0}

    def on_stage(name: str) -> None:
        if name == stage:
            seen["n"] += 1
            if seen["n"] == int(count):
                os.kill(os.getpid(), signal.SIGKILL)

    return on_stage


def main() -> int:
    from lmrl.config import load_config
    from lmrl.trainer import Trainer, build_run

    spec, overrides = sys.argv[1], sys.argv[2:]
    cfg = load_config(None, overrides)
    trainer = Trainer(build_run(cfg), cfg.trainer, on_stage=kill_at(spec))
    trainer.fit()
    return trainer.exit_code


if __name__ == "__main__":
    sys.exit(main())
