"""Seconds per step of the search demo's GRPO step with an instant retriever and with one that
answers after 300 ms, for ``rollout.multi_turn.pipeline_groups`` 1 (every row waits for the
turn's calls) and the default (groups decode while others' calls are in flight; docs/async.md).

The demo's run (`lmrl.demos.search`: the small Qwen2, 16 prompts x 8 samples, 160 response
tokens, the BM25 search tool, state masking) from a short warm start: the first SFT stage
(reading), so nearly every sample searches. The RL steps train at learning rate 0 so every
step rolls out the same policy, and the retriever's delay alternates step by step within one
run (instant, delayed, instant, ...) after one warm-up step, so both see the same machine
load. The delay wraps `SearchTool.call_batch` (one request per turn's queries, as a retrieval
server gets them): it sleeps, then answers.

Usage:
    python benchmarks/tool_latency.py                    # ~6 min on 2 cores
    python benchmarks/tool_latency.py --groups 1,2,4 --steps 6 --two-hop 1 --prompts 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

DELAY = {"s": 0.0}  # the retriever's delay for the current step


def _delayed_search() -> None:
    """Make every search answer ``DELAY["s"]`` seconds late."""
    from lmrl.tools.search import SearchTool

    plain = SearchTool.call_batch

    def call_batch(self, calls):
        if DELAY["s"]:
            time.sleep(DELAY["s"])
        return plain(self, calls)

    SearchTool.call_batch = call_batch


def warm_start(work: Path, seed: int, sft_steps: int, two_hop: float) -> tuple[Path, dict]:
    """The demo's data and model after ``sft_steps`` of its first SFT stage (reading)."""
    saved = work / "warm_start.json"
    if saved.is_file():  # an earlier run's, in the same --work
        warm = json.loads(saved.read_text())
        return Path(warm["model"]), {k: Path(v) for k, v in warm["data"].items()}
    from lmrl.demos.digits import run_sft
    from lmrl.demos.search import OBSERVATIONS, write_search_data
    from lmrl.models.tiny import build_tiny_model
    from lmrl.tools.search import SearchTool

    model_dir = build_tiny_model(work / "model", arch="qwen2", size="small", seed=seed)
    data = write_search_data(work / "data", seed, 512, 16, 512, two_hop, 1)
    agent = {"tools": {"search": SearchTool(data["corpus"], topk=1)}, "max_turns": 2}
    sft = run_sft(
        model_dir, data, work / "sft", seed=seed, target_acc=2.0, max_steps=sft_steps,
        lr=1e-3, batch_size=64, max_new_tokens=160, console=False, max_length=224,
        agent=agent, check_loss=0.0, mask_pattern=OBSERVATIONS,
    )  # fmt: skip
    print(f"warm start: {sft['steps']} SFT steps in {sft['seconds']:.0f}s, greedy exact match "
          f"{sft['acc']:.3f}", flush=True)  # fmt: skip
    saved.write_text(json.dumps({"model": str(sft["model"]),
                                 "data": {k: str(v) for k, v in data.items()}}))  # fmt: skip
    return Path(sft["model"]), data


def time_steps(model: Path, data: dict, work: Path, *, groups: int, steps: int, delay: float,
               seed: int, max_turns: int, prompts: int = 16, n: int = 8) -> dict:  # fmt: skip
    """One warm-up step, then ``2 * steps`` steps alternating instant / delayed retriever."""
    from lmrl.config import load_config
    from lmrl.demos.digits import _yaml_str
    from lmrl.trainer import Trainer, build_run

    cfg = load_config(None, [
        f"model.path={_yaml_str(model)}", f"data.train_files={_yaml_str(data['train'])}",
        "data.max_prompt_length=64", "data.max_response_length=160",
        f"data.train_batch_size={prompts}", f"rollout.n={n}", "rollout.temperature=0.7",
        "algorithm.adv_estimator=grpo", f"actor.ppo_mini_batch_size={prompts}", "actor.optim.lr=0",
        "actor.use_kl_loss=false", "model.enable_gradient_checkpointing=false",
        "reward.num_workers=0", f"trainer.total_training_steps={1 + 2 * steps}",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.val_before_train=false",
        "trainer.resume_mode=disable", "trainer.logger=[]", "trainer.device=cpu",
        f"trainer.default_local_dir={_yaml_str(work / f'rl-{groups}')}", f"trainer.seed={seed}",
        "rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[search]",
        f"rollout.multi_turn.max_turns={max_turns}", f"rollout.multi_turn.pipeline_groups={groups}",
        f"retriever.source={_yaml_str(data['corpus'])}", "retriever.topk=1",
        "actor.state_masking=true",
    ])  # fmt: skip
    trainer = Trainer(build_run(cfg), cfg.trainer)
    rows: list[dict] = []
    state = {"t": time.perf_counter()}

    def step_end(step: int, metrics: dict[str, float]) -> bool:
        now = time.perf_counter()
        rows.append({"step": step, "delay": DELAY["s"], "s": now - state["t"],
                     "gen_s": metrics.get("timing_s/gen", float("nan")),
                     "reward_s": metrics.get("timing_s/reward", float("nan")),
                     "calls": metrics.get("agent/tool_calls/mean", float("nan"))})  # fmt: skip
        DELAY["s"] = delay if DELAY["s"] == 0.0 and len(rows) > 1 else 0.0
        state["t"] = time.perf_counter()
        return False

    DELAY["s"] = 0.0
    trainer.fit(on_step_end=step_end)
    DELAY["s"] = 0.0
    measured = rows[1:]  # the first step warms up
    instant = [r["s"] for r in measured if r["delay"] == 0.0]
    delayed = [r["s"] for r in measured if r["delay"] > 0.0]
    out = {
        "groups": groups,
        "instant_s": statistics.median(instant),
        "delayed_s": statistics.median(delayed),
        "gen_instant_s": statistics.median(r["gen_s"] for r in measured if r["delay"] == 0.0),
        "gen_delayed_s": statistics.median(r["gen_s"] for r in measured if r["delay"] > 0.0),
        "reward_s": statistics.median(r["reward_s"] for r in measured),
        "calls_per_sample": statistics.mean(r["calls"] for r in measured),
        "steps": measured,
    }
    out["ratio"] = out["delayed_s"] / out["instant_s"]
    return out


def time_generation(model: Path, data: dict, work: Path, *, groups: list[int], reps: int,
                    delay: float, seed: int, max_turns: int, prompts: int, n: int) -> dict:  # fmt: skip
    """The rollout alone (the step's ``gen`` stage) on one batch of the demo's prompts, the
    same seed every time: ``reps`` rounds, each timing every (groups, delay) in turn, so all
    see the same machine load. Returns (groups, delay) -> median seconds."""
    import dataclasses

    from lmrl.config import load_config
    from lmrl.demos.digits import _yaml_str
    from lmrl.rollout.agent import AgentLoop
    from lmrl.trainer import build_run

    cfg = load_config(None, [
        f"model.path={_yaml_str(model)}", f"data.train_files={_yaml_str(data['train'])}",
        "data.max_prompt_length=64", "data.max_response_length=160",
        f"data.train_batch_size={prompts}", f"rollout.n={n}", "rollout.temperature=0.7",
        f"actor.ppo_mini_batch_size={prompts}", "actor.use_kl_loss=false",
        "reward.num_workers=0", "trainer.logger=[]",
        "trainer.device=cpu", f"trainer.default_local_dir={_yaml_str(work / 'gen')}",
        "trainer.resume_mode=disable", "rollout.multi_turn.enable=true",
        "rollout.multi_turn.tools=[search]", f"rollout.multi_turn.max_turns={max_turns}",
        f"retriever.source={_yaml_str(data['corpus'])}", "retriever.topk=1",
    ])  # fmt: skip
    parts = build_run(cfg)
    base = parts.engine
    assert isinstance(base, AgentLoop), type(base)
    loops = {g: AgentLoop(base.engine, base.tools, base.tokenizer, max_turns=base.max_turns,
                          format=base.format, pipeline_groups=g) for g in groups}  # fmt: skip
    batch = parts.train_data.get_batch(parts.sampler.next_batch())
    sampling = dataclasses.replace(parts.plan.sampling, seed=seed + 1)
    loops[groups[0]].generate(batch, n, sampling)  # warm-up
    times: dict[tuple[int, float], list[float]] = {}
    for _ in range(reps):
        for g in groups:
            for d in (0.0, delay):
                DELAY["s"] = d
                start = time.perf_counter()
                loops[g].generate(batch, n, sampling)
                times.setdefault((g, d), []).append(time.perf_counter() - start)
    DELAY["s"] = 0.0
    for loop in loops.values():
        loop._in_flight.close()  # the tools and the engine are the run's: closed with it
    parts.close()
    print("rollout alone, every round (s):", {f"{g}@{d}": [round(t, 2) for t in v]
                                             for (g, d), v in times.items()}, flush=True)  # fmt: skip
    return {key: statistics.median(v) for key, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", default="1,2", help="pipeline_groups values, comma-separated")
    parser.add_argument("--steps", type=int, default=4, help="steps of each delay per value")
    parser.add_argument("--delay", type=float, default=0.3, help="the slow retriever's seconds")
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--two-hop", type=float, default=0.0, help="questions needing 2 searches")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (demo: 16)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (demo: 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--gen-reps",
        type=int,
        default=0,
        help="also time the rollout alone, this many alternating rounds",
    )
    parser.add_argument("--skip-steps", action="store_true", help="only the rollout timing")
    parser.add_argument("--work", type=Path, default=None, help="reuses a warm start there")
    args = parser.parse_args()
    import torch

    # one thread: on a shared CPU two spinning OpenMP threads make a step 10x slower whenever
    # another process holds a core, which buries a 300 ms difference
    torch.set_num_threads(args.threads)
    work = args.work or Path(tempfile.mkdtemp(prefix="lmrl-tool-latency-"))
    model, data = warm_start(work, args.seed, args.sft_steps, args.two_hop)
    _delayed_search()
    max_turns = 2 if args.two_hop > 0 else 1  # as the demo
    results = []
    groups_list = [int(g) for g in args.groups.split(",")]
    if args.gen_reps:
        gen = time_generation(model, data, work, groups=groups_list, reps=args.gen_reps,
                              delay=args.delay, seed=args.seed, max_turns=max_turns,
                              prompts=args.prompts, n=args.n)  # fmt: skip
        base = gen[(groups_list[0], 0.0)]
        for g in groups_list:
            fast, slow = gen[(g, 0.0)], gen[(g, args.delay)]
            print(f"rollout alone, pipeline_groups={g}: {fast:.2f} s instant, {slow:.2f} s with "
                  f"the slow retriever, ratio {slow / fast:.2f}; instant against "
                  f"pipeline_groups={groups_list[0]}: {fast / base:.2f}", flush=True)  # fmt: skip
        results.append({"rollout_alone": {f"{g}@{d}": t for (g, d), t in gen.items()}})
    for groups in [] if args.skip_steps else groups_list:
        r = time_steps(model, data, work, groups=groups, steps=args.steps, delay=args.delay,
                       seed=args.seed, max_turns=max_turns, prompts=args.prompts,
                       n=args.n)  # fmt: skip
        results.append(r)
        print(f"pipeline_groups={groups}: {r['instant_s']:.2f} s/step instant, "
              f"{r['delayed_s']:.2f} s/step with a {args.delay * 1000:.0f} ms retriever, ratio "
              f"{r['ratio']:.2f} (gen {r['gen_instant_s']:.2f} / {r['gen_delayed_s']:.2f} s, "
              f"reward {r['reward_s']:.3f} s, {r['calls_per_sample']:.2f} searches per sample)",
              flush=True)  # fmt: skip
    (work / "tool_latency.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"rows: {work / 'tool_latency.json'}")


if __name__ == "__main__":
    main()
