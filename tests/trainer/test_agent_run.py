"""Multi-turn training runs: the step with tools, its metrics, exact resume, bad tool input,
and Search-R1's command line as written (seed 003)."""

from __future__ import annotations

import json
import math
import os
import signal
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.trainer.conftest import linked_workspace
from tests.trainer.test_tool_failures import retrieval_server

from lmrl.batch import response_tokens_mask
from lmrl.cli import main as cli_main
from lmrl.config import ConfigError, load_config
from lmrl.errors import ToolRunError
from lmrl.trainer import Trainer, build_run

STEPS = 4


def agent_args(root: Path, run: str, *extra: str) -> list[str]:
    """GRPO with the search tool over the task's corpus; the model calls it every few tokens
    (``build_search_caller``)."""
    return [
        f"model.path={root / 'model'}",
        f"data.train_files={root / 'data' / 'train.parquet'}",
        f"data.val_files={root / 'data' / 'test.parquet'}",
        "data.max_prompt_length=64", "data.max_response_length=96",
        "data.train_batch_size=4", "rollout.n=2",
        "actor.ppo_mini_batch_size=2", "actor.optim.lr=1e-2",
        "algorithm.adv_estimator=grpo", "actor.use_kl_loss=true",
        "rollout.multi_turn.enable=true", "rollout.multi_turn.max_turns=2",
        "rollout.multi_turn.max_obs_length=40",
        f"retriever.source={root / 'data' / 'corpus.parquet'}", "retriever.topk=1",
        "model.enable_gradient_checkpointing=false", "trainer.device=cpu",
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "trainer.logger=[]",
        f"trainer.default_local_dir={root / run}", "reward.num_workers=0",
        *extra,
    ]  # fmt: skip


def one_step(root: Path, run_dir: Path, *extra: str):
    """``(trainer, metrics)`` of one step of a multi-turn run (`agent_args`) in ``run_dir``."""
    cfg = load_config(None, agent_args(root, "one", "trainer.total_training_steps=1", *extra))
    cfg.trainer.default_local_dir = str(run_dir)
    trainer = Trainer(build_run(cfg), cfg.trainer)
    try:
        trainer.start.begin(trainer.global_step)  # config.yaml, as the run loop writes it
        return trainer, trainer.step()
    finally:
        trainer.close()


def test_a_multi_turn_step_trains_on_sampled_tokens_and_logs_tool_use(search_workspace, tmp_path):
    trainer, metrics = one_step(search_workspace, tmp_path / "one")
    batch = trainer.last_batch
    read, trained = response_tokens_mask(batch), batch["response_mask"]
    assert (trained & ~read).sum() == 0 and (read & ~trained).any()  # observations not trained
    observations = read & ~trained
    assert (batch["advantages"][observations] == 0).all()  # what they read is not trained
    assert (batch["rollout_log_probs"][observations] == 0).all()
    assert metrics["agent/tool_calls/mean"] > 0.5
    assert 0 < metrics["agent/obs_token_frac"] < 1
    assert metrics["agent/turns/mean"] >= 2
    for key in ("agent/valid_call_ratio", "agent/finish_ratio", "agent/tool_errors/mean"):
        assert math.isfinite(metrics[key]), key
    # the reward manager decoded the observations too, and scored the last sampled token
    assert metrics["response_length/mean"] == pytest.approx(read.sum(-1).float().mean().item())


def _children() -> set[int]:
    """The pids of this process's live children (from /proc, so the check starts none)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended while we looked
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def test_a_hanging_tool_from_a_users_file_is_killed_and_stops_the_run(search_workspace, tmp_path):
    """The default tool_processes=1: a user's search tool that never returns costs each call
    a timeout; its processes are killed, a first batch of nothing but timeouts stops the run
    (`ToolRunError`, as rewards do), and no worker outlives it."""
    user, pids = tmp_path / "tools.py", tmp_path / "pids"
    pids.mkdir()
    user.write_text(
        "import os, time\n"
        "def search(query: str) -> str:\n"
        '    """Search that never returns.\n\n    Args:\n        query: what to look for\n    """\n'
        f"    open(os.path.join({str(pids)!r}, str(os.getpid())), 'w').close()\n"
        "    time.sleep(600)\n"
        "    return 'never'\n"
    )
    before = _children()
    extra = (f"rollout.multi_turn.tool_path={user}", "rollout.multi_turn.tool_timeout_s=1")
    with pytest.raises(
        ToolRunError,
        match=r"the search tool failed on (\d+) of \1 calls of the "
        r"first batch \(100%\); first timeout: the search tool timed out after 1 s",
    ):
        one_step(search_workspace, tmp_path / "hang", *extra)
    ran_in = {int(p.name) for p in pids.iterdir()}
    assert ran_in and os.getpid() not in ran_in  # in worker processes, not the trainer
    leftover = _children() - before
    assert not leftover  # every tool worker stopped


@pytest.mark.slow
def test_a_multi_turn_run_killed_mid_step_resumes_bitwise_exact(
    search_workspace, tmp_path, train_subprocess
):
    """The tools are deterministic (BM25 rebuilt from the corpus; python runs with a fixed hash
    seed), so a run SIGKILLed in its 3rd rollout resumes to the uninterrupted run's weights."""
    root = linked_workspace(search_workspace, tmp_path)
    whole = train_subprocess(agent_args(root, "whole"))
    assert whole.returncode == 0, whole.stderr[-2000:]
    killed = train_subprocess(agent_args(root, "killed"), fault="gen@3")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = train_subprocess(agent_args(root, "killed"))
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-2000:]
    expected = load_file(root / "whole" / f"global_step_{STEPS}" / "actor.safetensors")
    actual = load_file(root / "killed" / f"global_step_{STEPS}" / "actor.safetensors")
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
    lines = [json.loads(line) for line in (root / "killed" / "metrics.jsonl").open()]
    assert [m["step"] for m in lines if "agent/tool_calls/mean" in m] == list(range(1, STEPS + 1))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["retriever.source=null"], "the search tool needs retriever.source"),
        (["retriever.source=/nowhere/corpus.parquet"], "retriever.source=/nowhere"),
        (["rollout.multi_turn.tools=[]"], "with no tools"),
        (
            ["rollout.multi_turn.tools=[search,nope]"],
            "rollout.multi_turn.tools='nope' is not a built-in tool",
        ),
        (["rollout.multi_turn.tool_path=/nowhere/tools.py"], "tool_path=/nowhere"),
        (["rollout.multi_turn.max_turns=-1"], "max_turns=-1"),
        (["rollout.multi_turn.format=xml"], "rollout.multi_turn.format"),
        (["algorithm.no_think_rl=true"], "no-think ablation"),
        (["rollout.ignore_eos=true"], "rollout.ignore_eos=true with rollout.multi_turn"),
    ],
)
def test_bad_tool_settings_are_one_line_errors(search_workspace, tmp_path, capsys, extra, message):
    code = cli_main(["train", *agent_args(search_workspace, str(tmp_path / "bad")), *extra])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert message in err and "Traceback" not in err


def test_a_tool_file_that_fails_to_import_is_a_clear_error(search_workspace, tmp_path, capsys):
    broken = tmp_path / "tools.py"
    broken.write_text("raise RuntimeError('half-written file')\n")
    args = agent_args(search_workspace, str(tmp_path / "run"), f"rollout.multi_turn.tool_path={broken}",
                      "rollout.multi_turn.tools=[search]")  # fmt: skip
    code = cli_main(["train", *args])
    err = capsys.readouterr().err
    assert code == 2 and "importing the tool file" in err and "half-written" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------------------- Search-R1
def search_r1_command_line(root: Path, url: str) -> list[str]:
    """Seed 003 §2.2's Search-R1 configuration, every line as written but the engine
    (``rollout.name=vllm`` -> ``hf``: no vLLM on a CPU), then the local paths, sizes and the
    retrieval server its training script adds (``max_turns``, ``retriever.url``...)."""
    return textwrap.dedent(f"""
        algorithm.adv_estimator=grpo
        actor_rollout_ref.model.path={root}/model
        actor_rollout_ref.model.enable_gradient_checkpointing=true
        actor_rollout_ref.model.use_remove_padding=True
        actor_rollout_ref.actor.optim.lr=1e-6
        actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.285
        actor_rollout_ref.actor.use_kl_loss=true
        actor_rollout_ref.actor.ppo_mini_batch_size=256
        actor_rollout_ref.actor.ppo_micro_batch_size=64
        actor_rollout_ref.actor.fsdp_config.param_offload=true
        actor_rollout_ref.actor.fsdp_config.grad_offload=true
        actor_rollout_ref.actor.fsdp_config.optimizer_offload=true
        actor_rollout_ref.rollout.log_prob_micro_batch_size=128
        actor_rollout_ref.rollout.tensor_model_parallel_size=1
        actor_rollout_ref.rollout.name=hf
        actor_rollout_ref.rollout.gpu_memory_utilization=0.6
        actor_rollout_ref.ref.log_prob_micro_batch_size=128
        actor_rollout_ref.ref.fsdp_config.param_offload=True
        actor_rollout_ref.actor.kl_loss_coef=0.001
        actor_rollout_ref.actor.kl_loss_type=low_var_kl
        algorithm.no_think_rl=false
        actor_rollout_ref.rollout.n_agent=5
        actor_rollout_ref.rollout.temperature=1
        actor_rollout_ref.actor.state_masking=true
        trainer.logger=['wandb']
        data.train_files={root}/data/train.parquet
        data.val_files={root}/data/test.parquet
        data.train_batch_size=256
        data.max_prompt_length=64
        data.max_response_length=64
        data.max_obs_length=32
        do_search=true
        max_turns=2
        retriever.url={url}
        retriever.topk=3
        trainer.total_training_steps=2
        trainer.default_local_dir={root}/run
        trainer.device=cpu
    """).split()


@pytest.mark.slow
def test_search_r1_command_line_runs_as_written(tmp_path, capsys, monkeypatch, search_caller):
    """256 prompts x n_agent 5 per step, k3 KL loss, state masking, a retrieval server."""
    from lmrl.data.tasks import write_task

    monkeypatch.setenv("WANDB_MODE", "")
    monkeypatch.delenv("WANDB_MODE")  # unset: the tracker runs W&B offline (no account)
    monkeypatch.setenv("WANDB_SILENT", "true")
    pytest.importorskip("wandb")
    search_caller(tmp_path / "model")
    paths = write_task("search_qa", tmp_path / "data", seed=0, num_train=256, num_test=8)
    with retrieval_server(paths["corpus"], topk=3) as url:
        args = search_r1_command_line(tmp_path, url)
        cfg = load_config(None, args)
        assert cfg.rollout.n == 5 and cfg.actor.state_masking and cfg.rollout.multi_turn.enable
        assert (cfg.retriever.source, cfg.retriever.topk) == (url, 3)
        assert (cfg.rollout.multi_turn.max_turns, cfg.rollout.multi_turn.max_obs_length) == (2, 32)
        assert cfg.actor.kl_loss_type == "low_var_kl"
        code = cli_main(["train", *args])
    assert code == 0, capsys.readouterr().err[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    trained = [m for m in lines if "actor/kl_loss" in m]
    assert [m["step"] for m in trained] == [1, 2]
    assert all(m["agent/tool_calls/mean"] > 0 for m in trained)
    assert all(math.isfinite(m["actor/pg_loss"]) for m in trained)


def test_search_r1_keys_translate(search_workspace):
    paths = [
        f"model.path={search_workspace / 'model'}",
        f"data.train_files={search_workspace / 'data' / 'train.parquet'}",
    ]
    cfg = load_config(
        None,
        [
            *paths,
            "actor_rollout_ref.rollout.n_agent=5", "actor_rollout_ref.actor.state_masking=false",
            "max_turns=4", "do_search=true", "retriever.url=http://127.0.0.1:1/retrieve",
            "data.max_obs_length=100", "algorithm.no_think_rl=false",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
        ],
    )  # fmt: skip
    assert cfg.rollout.n == 5 and not cfg.actor.state_masking
    assert cfg.rollout.multi_turn.enable and cfg.rollout.multi_turn.max_turns == 4
    assert cfg.rollout.multi_turn.max_obs_length == 100
    with pytest.raises(ConfigError, match="tool_config_path"):
        load_config(None, [*paths, "actor_rollout_ref.rollout.multi_turn.tool_config_path=/x.yaml"])


def test_lmrl_train_in_chat_format_renders_the_tools_into_its_prompts(tmp_path, caplog):
    """``rollout.multi_turn.format=chat`` through ``lmrl train``: the start-up template check
    passes, the prompts carry the tools as the template renders them, so no prompt differs
    from the template's conversation (no warning), and the run trains."""
    import logging

    from tests.rollout.chat_templates import tokenizer_for
    from transformers import AutoModelForCausalLM

    from lmrl.data.tasks import write_task
    from lmrl.models.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", arch="qwen2", size="tiny", seed=0)
    tok = tokenizer_for("qwen2.5")  # Qwen2.5's template and tokens on the byte tokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    write_task("digits", tmp_path / "data", seed=0, num_train=8, num_test=4)
    tools = tmp_path / "tools.py"
    tools.write_text('def lookup(word: str) -> str:\n    """Look a word up.\n\n    Args:\n'
                     '        word: the word\n    """\n    return "found " + word\n')  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="lmrl"):
        code = cli_main([
            "train", f"model.path={model_dir}", f"data.train_files={tmp_path / 'data' / 'train.parquet'}",
            "data.max_prompt_length=1024", "data.max_response_length=24",
            "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
            "algorithm.adv_estimator=grpo", "model.enable_gradient_checkpointing=false",
            "rollout.multi_turn.enable=true", "rollout.multi_turn.format=chat",
            "rollout.multi_turn.tools=[lookup]", f"rollout.multi_turn.tool_path={tools}",
            "trainer.total_training_steps=1", "trainer.device=cpu", "trainer.logger=[]",
            f"trainer.default_local_dir={tmp_path / 'run'}", "reward.num_workers=0",
        ])  # fmt: skip
    assert code == 0
    assert not [r for r in caplog.records if "agent format chat" in r.getMessage()]
    from transformers import AutoTokenizer

    final = AutoTokenizer.from_pretrained(tmp_path / "run" / "final")
    assert "<tools>" in final.chat_template  # the run's model keeps the template it spoke
