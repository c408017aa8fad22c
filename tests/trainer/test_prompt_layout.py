"""One prompt layout from SFT to RL: an SFT file with plain-string prompts and an RL file with
the same prompts as chat messages give the model the same tokens; ``lmrl sft`` records the
layout in ``final/`` and ``lmrl train`` refuses, in one line before its first step, a warm
start that saw its prompts laid out otherwise. Runs on the tiny model's byte tokenizer (ChatML
template), so the chat and verbatim renderings differ."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmrl.cli import main
from lmrl.data import RLDataset, SFTDataset
from lmrl.data.layout import LAYOUT_FILE, PromptLayout, check_warm_start, write_layout
from lmrl.data.tasks import generate_rows
from lmrl.errors import DataError
from lmrl.models import load_tokenizer

LMRL = Path(sys.executable).parent / "lmrl"


def lmrl(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([str(LMRL), *map(str, argv)], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip


def prompt_ids(ids: list[int], loss_mask: list[bool]) -> list[int]:
    """An SFT example's context before its first trained token."""
    return ids[: loss_mask.index(True)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """8 ``digits`` rows (2-3 digits): the SFT file in the common prompt/response layout (a
    plain-string ``prompt``, a ``response`` and a ``messages`` column) and the RL file in
    verl's (``prompt`` as chat messages)."""
    root = tmp_path_factory.mktemp("layout")
    rl = generate_rows("digits", num_train=8, num_test=0, seed=0, min_len=2, max_len=3)["train"]
    sft = []
    for row in rl:
        answer = row["reward_model"]["ground_truth"]
        sft.append({
            "prompt": row["prompt"][0]["content"],
            "response": answer,
            "messages": [*row["prompt"], {"role": "assistant", "content": answer}],
            "data_source": "digits",
        })  # fmt: skip
    pq.write_table(pa.Table.from_pylist(sft), root / "sft.parquet")
    pq.write_table(pa.Table.from_pylist(rl), root / "rl.parquet")
    return {"sft": root / "sft.parquet", "rl": root / "rl.parquet"}


def test_string_prompt_sft_rows_and_chat_message_rl_rows_give_the_same_prompt_tokens(
    tiny_workspace, files
):
    tok = load_tokenizer(tiny_workspace / "model")
    rl = RLDataset(files["rl"], tok)
    sft = SFTDataset(files["sft"], tok)
    assert len(sft) == len(rl) == 8
    for (ids, mask), row in zip(sft.examples, rl.rows, strict=True):
        assert prompt_ids(ids, mask) == row["input_ids"]
    # RL's own plain-string prompts follow the same rule
    plain = RLDataset(files["sft"], tok)
    assert [r["input_ids"] for r in plain.rows] == [r["input_ids"] for r in rl.rows]
    assert sft.layout == PromptLayout("chat", ("chat",), False)
    # verbatim (the key that keeps a string as it is) is another layout: other tokens
    verbatim = SFTDataset(files["sft"], tok, prompt_template="verbatim")
    ids, mask = verbatim.examples[0]
    assert prompt_ids(ids, mask) != rl.rows[0]["input_ids"]
    assert verbatim.layout.renderings == ("verbatim",)


def test_the_check_names_both_layouts_and_the_key_that_aligns_them(tmp_path):
    def refused(recorded, run) -> str:
        write_layout(tmp_path, recorded)
        with pytest.raises(DataError) as info:
            check_warm_start(tmp_path, run)
        message = str(info.value)
        assert "\n" not in message and LAYOUT_FILE in message
        assert message.startswith(f"model.path={tmp_path} was fine-tuned by lmrl sft")
        return message

    verbatim = PromptLayout("verbatim", ("verbatim",), False)
    chat_messages = PromptLayout("chat", ("chat",), True)
    chat_strings = PromptLayout("chat", ("chat",), False)
    message = refused(verbatim, chat_messages)
    assert "on prompts rendered verbatim" in message and "with the chat template" in message
    assert "(its chat-message prompts)" in message
    assert message.endswith("rerun lmrl sft with data.prompt_template=chat")
    message = refused(verbatim, chat_strings)
    assert "(data.prompt_template=chat)" in message
    assert "set data.prompt_template=verbatim, as the lmrl sft run did" in message
    message = refused(chat_strings, PromptLayout("verbatim", ("verbatim",), False))
    assert message.endswith("set data.prompt_template=chat, as the lmrl sft run did")
    # the same rendering, a warm start that saw both, or a model without a record: no error
    write_layout(tmp_path, chat_strings)
    check_warm_start(tmp_path, chat_messages)
    write_layout(tmp_path, PromptLayout("verbatim", ("chat", "verbatim"), True))
    check_warm_start(tmp_path, verbatim.merged(chat_messages))
    check_warm_start(tmp_path / "elsewhere", verbatim)
    (tmp_path / LAYOUT_FILE).write_text("{")
    with pytest.raises(DataError, match=f"{LAYOUT_FILE}: not a prompt layout record"):
        check_warm_start(tmp_path, verbatim)


def sft_args(model, train, run_dir, *extra):
    return ["sft", f"model.path={model}", f"data.train_files={train}",
            f"trainer.default_local_dir={run_dir}", "model.enable_gradient_checkpointing=false",
            "trainer.device=cpu", "trainer.logger=[]", "data.train_batch_size=8",
            "optim.lr=1e-2", "optim.lr_warmup_steps_ratio=0", *extra]  # fmt: skip


def train_args(model, data, run_dir, *extra):
    """One GRPO step on ``data``, validated on it before the step and after."""
    return ["train", f"model.path={model}", f"data.train_files={data}", f"data.val_files={data}",
            f"trainer.default_local_dir={run_dir}", "model.enable_gradient_checkpointing=false",
            "trainer.device=cpu", "trainer.logger=[]", "algorithm.adv_estimator=grpo",
            "rollout.n=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
            "data.max_prompt_length=64", "data.max_response_length=6", "trainer.val_before_train=true",
            "trainer.test_freq=1", "trainer.total_training_steps=1", *extra]  # fmt: skip


def test_a_string_prompt_warm_start_scores_in_rl_as_it_did_after_sft(tiny_workspace, files,
                                                                     tmp_path):  # fmt: skip
    """The case as a user meets it: ``lmrl sft`` on plain-string prompts, ``lmrl train`` on
    the same prompts as chat messages. Rendered verbatim, this warm start answered 0 of the 8
    prompts RL gave it in chat layout; rendered as a user turn, RL validates it at 1.0."""
    sft = sft_args(tiny_workspace / "model", files["sft"], tmp_path / "sft",
                   "trainer.total_training_steps=100")  # fmt: skip
    assert main(sft) == 0
    final = tmp_path / "sft" / "final"
    record = json.loads((final / LAYOUT_FILE).read_text())
    assert (record["prompt_template"], record["renderings"]) == ("chat", ["chat"])
    assert main(train_args(final, files["rl"], tmp_path / "rl")) == 0
    lines = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    before = next(x for x in lines if x["step"] == 0)  # validation before the first step
    assert before["val/digits/acc"] >= 0.75


def test_a_warm_start_in_another_layout_is_refused_in_one_line_before_any_step(
    tiny_workspace, files, tmp_path
):
    sft = sft_args(tiny_workspace / "model", files["sft"], tmp_path / "sft",
                   "trainer.total_training_steps=1", "data.prompt_template=verbatim")  # fmt: skip
    assert main(sft) == 0
    final = tmp_path / "sft" / "final"
    done = lmrl(*train_args(final, files["rl"], tmp_path / "rl"))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = [x for x in done.stderr.splitlines() if not x.startswith(("INFO ", "WARNING "))]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"lmrl train: error: model.path={final} was fine-tuned")
    assert "rendered verbatim" in lines[0] and "with the chat template" in lines[0]
    assert lines[0].endswith("rerun lmrl sft with data.prompt_template=chat")
    assert not list((tmp_path / "rl").glob("global_step_*"))
    metrics = tmp_path / "rl" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()
