"""``lmrl demo --task search``: RL teaches a tiny model to use a search tool (Search-R1 at toy
scale, on the CPU).

    1 model   the ~2M-parameter Qwen2 of the digits demo
    2 data    ``search_qa``: ``where does Vokar live?`` about invented people, whose facts are
              only in the corpus it writes (``lmrl.data.search_qa``); the people of the
              validation questions are never asked about in training
    3 SFT 1/2 reading: real trajectories (``<search>Vokar</search>``, the tool's observation,
              ``<answer>Lumo</answer>``, observations not trained) until the model answers
              with the tool (greedy exact match ``read_target_acc``)
    4 SFT 2/2 answering from memory: the same questions, mostly answered at once, at a low
              learning rate until greedy exact match is at most ``SFT_MAX_ACC``: the model
              prefers guessing to searching
    5 GRPO    multi-turn rollouts with the BM25 search tool and state masking: the samples
              that search score, the guesses do not, so RL learns to search
    6 plot    ``rl/plot.png`` with the tool-use panel (searches per sample)

Why two stages (``docs/agents.md`` has the runs): GRPO at this scale does not finish a
half-learned copy skill (exact match on names is a sparse reward and sampling breaks copies),
but it learns one decision that pays quickly, and deciding to search is what Search-R1's RL
teaches.

``search=False`` trains the same warm start with the tool turned off (the model writes its own
"observations"): validation stays near chance, since no answer is in the weights.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

from lmrl.demos.digits import _key, _yaml_str, run_rl, run_sft
from lmrl.demos.folder import DEMO_KEY, demo_dir

__all__ = ["run_search_demo", "write_search_data"]

TASK = "search_qa"
SFT_MAX_ACC = 0.2  # the warm start stops at or under this: the learning is left to RL
RECALL_FRACTION = 0.7  # of the second SFT stage's examples, answered without searching
# the first stage checks accuracy from this training loss on (the copy skill appears at ~0.12,
# near step 175; each check is a multi-turn generation, a few seconds)
READ_CHECK_LOSS = 0.2
OBSERVATIONS = r"(?s)<information>.*?</information>"  # read in SFT, not trained (data.mask_pattern)


def write_search_data(
    out_dir: Path,
    seed: int,
    num_train: int,
    num_val: int,
    num_sft: int,
    two_hop: float,
    topk: int,
    search_fraction: float = 1.0,
) -> dict[str, Path]:
    """The task's splits and corpus, and ``sft.parquet``: ``num_sft`` demonstrations (prompt
    and response columns) drawn apart from the validation questions. A ``search_fraction`` of
    them search: the response is the trajectory the agent loop would build, with the search
    tool's real observations; the others answer at once (``<answer>city</answer>``, the fact
    recalled as if known)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmrl.data.tasks import generate_rows, write_task
    from lmrl.rollout.agent import TagFormat
    from lmrl.tools.search import SearchTool

    paths = write_task(
        TASK, out_dir, seed=seed, num_train=num_train, num_test=num_val, two_hop=two_hop
    )
    held_out = {_key(row) for row in pq.read_table(paths["test"]).to_pylist()}
    rows = generate_rows(
        TASK, num_train=num_sft + num_val, num_test=0, seed=seed + 1, two_hop=two_hop
    )["train"]
    rows = [row for row in rows if _key(row) not in held_out][:num_sft]
    tool, fmt = SearchTool(paths["corpus"], topk=topk), TagFormat()
    rng = random.Random(f"search-demonstrations-{seed}")
    examples = []
    for row in rows:
        searches = row["extra_info"]["queries"] if rng.random() < search_fraction else []
        parts = [f"<search>{q}</search>" + fmt.observation(tool({"query": q})) for q in searches]
        answer = row["reward_model"]["ground_truth"]["target"][0]
        examples.append(
            {"prompt": row["prompt"], "response": "".join(parts) + f"<answer>{answer}</answer>"}
        )
    paths["sft"] = Path(out_dir) / "sft.parquet"
    pq.write_table(pa.Table.from_pylist(examples), paths["sft"])
    # the same questions, most answered at once, as a model that knows facts by heart does
    recall = [
        {"prompt": row["prompt"],
         "response": f"<answer>{row['reward_model']['ground_truth']['target'][0]}</answer>"}
        if rng.random() < RECALL_FRACTION else example
        for row, example in zip(rows, examples, strict=True)
    ]  # fmt: skip
    paths["sft_recall"] = Path(out_dir) / "sft_recall.parquet"
    pq.write_table(pa.Table.from_pylist(recall), paths["sft_recall"])
    return paths


def run_search_demo(
    out_dir: str | Path = "lmrl-demo-search",
    *,
    seed: int = 0,
    fast: bool = False,
    search: bool = True,
    two_hop: float = 0.0,
    topk: int = 1,
    num_train: int = 1500,
    num_val: int = 64,
    num_sft: int = 1000,
    read_target_acc: float = 0.6,
    sft_max_steps: int = 400,
    sft_lr: float = 1e-3,
    recall_lr: float = 3e-5,
    recall_max_steps: int = 60,
    rl_steps: int = 60,
    rl_lr: float = 1e-4,
    rl_warmup_steps: int = 5,
    rl_temperature: float = 0.7,
    target_acc: float = 0.6,
    test_freq: int = 5,
    max_response_length: int = 160,
    console: bool = True,
    warm_start: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the search demo (see the module docstring); return its summary (``demo.json``).

    Args:
        search: the search tool on during RL (off = the ablation).
        warm_start: the summary of an earlier run of this demo (its ``demo.json``): RL starts
            from that run's warm start and data instead of building them, so the ablation
            trains the very same model (the data and SFT arguments then go unused).
        two_hop: fraction of questions that need two searches.
        topk: passages per search.
        num_sft: demonstrations in the warm start's sets.
        read_target_acc: the first SFT stage stops once greedy exact match with the tool
            reaches this (the model can search and read).
        sft_lr: the first stage's learning rate.
        recall_lr, recall_max_steps: the second stage's (answering from memory), which stops
            at the first step whose greedy exact match is at most ``SFT_MAX_ACC``.
        max_response_length: tokens per response, observations included.
        The rest: as `lmrl.demos.digits.run_demo`.
    """
    from lmrl.logging.plot import plot_run
    from lmrl.models.tiny import build_tiny_model
    from lmrl.tools.search import SearchTool

    start = time.perf_counter()
    out = Path(out_dir)
    size, batch, prompts, n = "small", 64, 16, 8
    max_turns = 2 if two_hop > 0 else 1
    check_every = 4
    if fast:
        size, batch, prompts, n = "tiny", 8, 4, 4
        sft_max_steps, recall_max_steps, rl_steps, test_freq, rl_warmup_steps = 3, 2, 2, 1, 0
        num_train, num_val, num_sft, check_every = 64, 8, 16, 1
        read_target_acc = target_acc = 2.0  # never reached: run the capped steps
    with demo_dir(out, "search"):
        if warm_start is None:
            model_dir = build_tiny_model(out / "model", arch="qwen2", size=size, seed=seed)
            data = write_search_data(out / "data", seed, num_train, num_val, num_sft, two_hop, topk)
            # accuracy is measured the way RL validates: greedy, in turns, with the search tool
            agent = {
                "tools": {"search": SearchTool(data["corpus"], topk=topk)},
                "max_turns": max_turns,
            }
            common = dict(
                seed=seed, batch_size=batch, max_new_tokens=max_response_length, console=console,
                max_length=64 + max_response_length, agent=agent, mask_pattern=OBSERVATIONS,
            )  # fmt: skip
            if console:
                print(f"lmrl demo --task search: model {model_dir}, data {out / 'data'}; SFT 1/2: "
                      f"{num_sft} demonstrations of searching and reading", flush=True)  # fmt: skip
            read = run_sft(
                model_dir, data, out / "sft", target_acc=read_target_acc, max_steps=sft_max_steps,
                lr=sft_lr, check_loss=READ_CHECK_LOSS, check_every=check_every, max_acc=1.0, **common,
            )  # fmt: skip
            if console:
                print(f"lmrl demo: SFT 1/2 stopped at step {read['steps']}, greedy exact match "
                      f"with the tool {read['acc']:.3f}; SFT 2/2: answering from memory",
                      flush=True)  # fmt: skip
            recall = run_sft(
                read["model"], {**data, "sft": data["sft_recall"]}, out / "sft_recall", target_acc=2.0,
                max_steps=recall_max_steps, lr=recall_lr, check_loss=math.inf,
                stop_below=SFT_MAX_ACC, **common,
            )  # fmt: skip
            if console:
                print(f"lmrl demo: SFT 2/2 stopped at step {recall['steps']}, greedy exact match "
                      f"{recall['acc']:.3f}; GRPO with {'the search tool' if search else 'no tool'}",
                      flush=True)  # fmt: skip
            sft = {
                "sft_model": str(recall["model"]),
                "data": data,
                "sft_steps": read["steps"] + recall["steps"],
                "acc_reading": read["acc"],
                "acc_after_sft": recall["acc"],
                "sft_seconds": round(read["seconds"] + recall["seconds"], 1),
            }
        else:  # the keys of the summary below
            sft = {k: warm_start[k] for k in ("sft_model", "sft_steps", "acc_reading",
                                              "acc_after_sft")}  # fmt: skip
            sft["sft_seconds"] = 0.0  # this run trained none
            data = sft["data"] = {k: Path(v) for k, v in warm_start["data"].items()}
            if console:
                print(f"lmrl demo: the warm start of {warm_start['out_dir']}; GRPO with "
                      f"{'the search tool' if search else 'no tool'}", flush=True)  # fmt: skip
        overrides = [
            f"rollout.temperature={rl_temperature}",
            f"rollout.multi_turn.enable={str(search).lower()}",
            "rollout.multi_turn.tools=[search]",
            f"rollout.multi_turn.max_turns={max_turns}",
            f"retriever.source={_yaml_str(data['corpus'])}",
            f"retriever.topk={topk}",
            "actor.state_masking=true",
            f"trainer.experiment_name=search-{'grpo' if search else 'no-tool'}",
        ]
        rl = run_rl(
            Path(sft["sft_model"]), data, out / "rl", seed=seed, steps=rl_steps, lr=rl_lr,
            prompts_per_step=prompts, n=n, max_response_length=max_response_length,
            test_freq=test_freq, target_acc=target_acc, console=console,
            warmup_steps=rl_warmup_steps, overrides=overrides, task=TASK,
        )  # fmt: skip
        plot = plot_run(rl["dir"])
        calls = [h["agent/tool_calls/mean"] for h in rl["history"] if "agent/tool_calls/mean" in h]
        summary = {
            DEMO_KEY: "search",
            "out_dir": str(out),
            "search": search,
            "sft_model": sft["sft_model"],
            "data": {k: str(v) for k, v in data.items()},
            "rl_dir": str(rl["dir"]),
            "plot": str(plot),
            "checkpoint": str(rl["checkpoint"]),
            "sft_steps": sft["sft_steps"],
            "rl_steps": rl["steps"],
            "acc_reading": sft["acc_reading"],
            "acc_after_sft": sft["acc_after_sft"],
            "acc_before_rl": rl["acc_before"],
            "acc_after_rl": rl["acc"],
            "tool_calls_first": calls[0] if calls else None,
            "tool_calls_last": calls[-1] if calls else None,
            "sft_seconds": sft["sft_seconds"],
            "rl_seconds": round(rl["seconds"], 1),
            "seconds": round(time.perf_counter() - start, 1),
        }
        (out / "demo.json").write_text(json.dumps(summary, indent=1) + "\n")
        if console:
            print(format_search_summary(summary), flush=True)
        return summary


def format_search_summary(summary: dict[str, Any]) -> str:
    """The lines printed at the end of the search demo."""
    calls = ""
    if summary["tool_calls_first"] is not None:
        calls = (f"  searches per sample: {summary['tool_calls_first']:.2f} at the first step, "
                 f"{summary['tool_calls_last']:.2f} at the last")  # fmt: skip
    return "\n".join(
        line
        for line in [
            "",
            f"lmrl demo --task search finished in {summary['seconds']:.0f}s "
            f"(SFT {summary['sft_seconds']:.0f}s, RL {summary['rl_seconds']:.0f}s), search "
            f"tool {'on' if summary['search'] else 'off'}",
            "  validation exact match (val/search_qa/acc, greedy, people never asked about in "
            "training):",
            f"    after SFT ({summary['sft_steps']} steps):  {summary['acc_before_rl']:.3f} "
            f"(it could: {summary['acc_reading']:.3f} when it still searched)",
            f"    after GRPO ({summary['rl_steps']} steps): {summary['acc_after_rl']:.3f}",
            calls or None,
            f"  RL run:     {summary['rl_dir']}",
            f"  plot:       {summary['plot']}",
            f"  checkpoint: {summary['checkpoint']}",
        ]
        if line is not None
    )
