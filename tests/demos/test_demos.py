"""``lmrl demo`` (``lmrl.demos``): a fast smoke run end to end through the command line (on the
run loop ``lmrl train`` and ``lmrl sft`` use), starting fresh over a previous demo (its
``demo.json`` says so), refusing a directory that is not one or that a running demo holds; the demo's data files and the plain-prompt option of the task
writer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from lmrl.cli import main as cli_main
from lmrl.data.tasks import generate_rows
from lmrl.demos.digits import ACC_KEY, SUMMARY_FILE, run_demo, write_demo_data
from lmrl.demos.flow import run_flow_demo

SUMMARY_KEYS = {
    "lmrl_demo", "out_dir", "sft_dir", "sft_model", "rl_dir", "metrics", "plot", "checkpoint", "sft_steps",
    "rl_steps", "acc_after_sft", "acc_before_rl", "acc_after_rl", "sft_seconds", "rl_seconds",
    "seconds",
}  # fmt: skip


def test_fast_demo_through_the_cli(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli_main(["demo", "--fast", "--out", str(out), "--seed", "1"]) == 0
    printed = capsys.readouterr().out

    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert set(summary) == SUMMARY_KEYS
    for key in ("plot", "checkpoint", "rl_dir", "sft_model"):
        assert summary[key] in printed
    assert summary["sft_steps"] == 3 and summary["rl_steps"] == 2
    for key in ("acc_after_sft", "acc_before_rl", "acc_after_rl"):
        assert 0.0 <= summary[key] <= 1.0

    assert Path(summary["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    checkpoint = Path(summary["checkpoint"])
    assert checkpoint == out / "rl" / "global_step_2"
    assert (checkpoint / "actor.safetensors").stat().st_size > 0
    assert (checkpoint / "manifest.json").is_file()  # a complete checkpoint
    assert (Path(summary["sft_model"]) / "config.json").is_file()

    lines = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
    validated = {line["step"]: line[ACC_KEY] for line in lines if ACC_KEY in line}
    assert set(validated) == {0, 1, 2}  # before training and every step (test_freq=1)
    assert validated[0] == summary["acc_before_rl"]
    assert validated[2] == summary["acc_after_rl"]
    # the warm start measured its greedy accuracy after its steps
    sft_lines = [json.loads(line) for line in (out / "sft" / "metrics.jsonl").open()]
    # (its on_step_end runs after every step, the last one included)
    assert [line["step"] for line in sft_lines if "sft/val_acc" in line] == [1, 2, 3]


def test_a_previous_demo_is_replaced(tmp_path):
    out = tmp_path / "demo"
    run_demo(out, fast=True, console=False)
    stale = out / "rl" / "stale.txt"
    stale.write_text("from an earlier run")
    summary = run_demo(out, fast=True, console=False)
    assert not stale.exists()
    assert Path(summary["checkpoint"]).is_dir()


def test_refuses_a_directory_that_is_not_a_demo(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a previous lmrl demo"):
        run_demo(out, fast=True, console=False)
    assert cli_main(["demo", "--fast", "--out", str(out)]) == 2
    assert "not a previous lmrl demo" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "keep me"


def snapshot(path: Path) -> dict[str, bytes | None]:
    """Every entry under ``path``: a file's bytes, None for a directory."""
    return {
        str(p.relative_to(path)): p.read_bytes() if p.is_file() else None
        for p in sorted(path.rglob("*"))
    }


def users_project(root: Path) -> Path:
    """A user's directory holding only names a demo writes: ``data/`` and ``model/``."""
    (root / "data").mkdir(parents=True)
    (root / "data" / "train.parquet").write_bytes(b"the user's own data")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text('{"model_type": "mine"}')
    return root


@pytest.mark.parametrize("task", ["digits", "search", "flow"])
@pytest.mark.parametrize(
    "make",
    [
        users_project,
        lambda root: (root.mkdir(), (root / "notes.txt").write_text("keep me"), root)[-1],
        # a demo.json of the user's own: not a demo's (it names none)
        lambda root: (users_project(root), (root / "demo.json").write_text('{"a": 1}'), root)[-1],
    ],
    ids=["data-and-model", "a-file", "a-json-of-its-own"],
)  # fmt: skip
def test_demo_out_that_is_not_a_demos_is_refused_before_any_work_and_untouched(
    task, make, tmp_path, capsys
):
    out = make(tmp_path / "mine")
    before = snapshot(out)
    assert cli_main(["demo", "--task", task, "--fast", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"--out {out}: a non-empty directory that is not a previous lmrl demo" in err
    assert "nothing was changed: pick another --out" in err
    assert snapshot(out) == before


@pytest.mark.parametrize("task", ["digits", "flow"])
def test_a_previous_or_interrupted_demo_is_replaced_by_its_demo_json(task, tmp_path, monkeypatch):
    """A demo writes its ``demo.json`` first: one stopped half-way is replaced as well. The
    demo is cut short at its first piece of work (the data), after the directory is ready."""
    out = tmp_path / "demo"
    (out / "rl").mkdir(parents=True)
    (out / "rl" / "stale.txt").write_text("from an earlier run")
    (out / "own-name.txt").write_text("any name: the marker decides, not the names")
    (out / SUMMARY_FILE).write_text(json.dumps({"lmrl_demo": "search"}))

    class Cut(Exception):
        pass

    def cut(*args, **kwargs):
        raise Cut

    monkeypatch.setattr("lmrl.models.tiny.build_tiny_model", cut)  # the digits demo's first
    monkeypatch.setattr("lmrl.data.tasks.write_task", cut)  # the flow demo's first
    with pytest.raises(Cut):
        (run_flow_demo if task == "flow" else run_demo)(out, fast=True, console=False)
    assert snapshot(out) == {SUMMARY_FILE: json.dumps({"lmrl_demo": task}).encode() + b"\n"}


@pytest.mark.parametrize("where", [".", "rl"])
def test_a_demo_running_in_out_is_refused(where, tmp_path, capsys):
    """Another ``lmrl demo`` into the directory of one that runs, or of one a run (an ``lmrl
    train`` resuming the demo's GRPO) still writes: refused, nothing removed."""
    out = tmp_path / "demo"
    (out / "rl").mkdir(parents=True)
    (out / SUMMARY_FILE).write_text(json.dumps({"lmrl_demo": "digits"}))
    (out / "model").mkdir()
    held = out / where
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from lmrl.run.lock import RunDirLock; "
         "RunDirLock(sys.argv[1], 'lmrl demo').acquire(); print('held', flush=True); "
         "time.sleep(600)", str(held)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cli_main(["demo", "--fast", "--out", str(out)]) == 2
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err.strip()
    assert err == (
        f"lmrl demo: error: {held} is in use by pid {holder.pid} (lmrl demo): wait for it to "
        "end or choose another --out"
    )
    assert (out / "model").is_dir() and (out / "rl").is_dir()


def test_the_warm_start_examples_are_2_to_8_digits_never_validated_on(tmp_path):
    paths = write_demo_data(tmp_path, seed=0, num_train=300, num_val=200, prompt_format=None)
    tables = {name: pq.read_table(path).to_pylist() for name, path in paths.items()}

    def numbers(split):
        return [row["prompt"][0]["content"].split()[1] for row in tables[split]]

    assert len(tables["sft"]) == 300
    assert {len(x) for x in numbers("sft")} == set(range(2, 9))
    assert {len(x) for x in numbers("train")} == {4, 5, 6}
    assert not set(numbers("sft")) & set(numbers("test"))
    assert all(row["reward_model"]["ground_truth"] == x[::-1]
               for row, x in zip(tables["sft"], numbers("sft"), strict=True))  # fmt: skip


def test_plain_string_prompts_of_the_task_writer():
    rows = generate_rows("digits", num_train=3, num_test=2, seed=0, prompt_format="{}=")
    chat = generate_rows("digits", num_train=3, num_test=2, seed=0)
    for split in ("train", "test"):
        for plain, templated in zip(rows[split], chat[split], strict=True):
            assert plain["prompt"] == templated["prompt"][0]["content"] + "="
            assert plain["prompt"].startswith("reverse ")
            assert plain["reward_model"] == templated["reward_model"]
    for bad in ("no placeholder", "{}{}", 3):
        with pytest.raises(ValueError, match="prompt_format"):
            generate_rows("digits", num_train=1, num_test=1, prompt_format=bad)


def test_fast_search_demo_through_the_cli(tmp_path, capsys):
    """``lmrl demo --task search --fast``: data, corpus, multi-turn demonstrations, SFT, GRPO
    with the search tool, and the plot's tool-use panel, in seconds."""
    out = tmp_path / "search"
    assert cli_main(["demo", "--task", "search", "--fast", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "demo.json").read_text())
    assert summary["search"] is True and summary["rl_steps"] == 2
    assert summary["plot"] in printed and "search tool on" in printed
    assert Path(summary["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every demonstration is a real trajectory: the tool's own observation of its query
    from lmrl.rollout.agent import TagFormat
    from lmrl.tools import SearchTool

    tool, fmt = SearchTool(out / "data" / "corpus.parquet", topk=1), TagFormat()
    for row in pq.read_table(out / "data" / "sft.parquet").to_pylist():
        query = row["response"].split("<search>")[1].split("</search>")[0]
        assert fmt.observation(tool({"query": query})) in row["response"]
    lines = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").open()]
    assert all("agent/tool_calls/mean" in line for line in lines if line["step"] > 0)
    assert cli_main(["demo", "--task", "digits", "--no-tool", "--out", str(tmp_path / "x")]) == 2
    # the ablation from this run's warm start: no model, data or SFT of its own
    from lmrl.demos.search import run_search_demo

    ablation = run_search_demo(
        tmp_path / "no-tool", fast=True, search=False, console=False, warm_start=summary
    )
    assert sorted(p.name for p in (tmp_path / "no-tool").iterdir()) == ["demo.json", "rl"]
    for key in ("sft_model", "data", "sft_steps", "acc_reading", "acc_after_sft"):
        assert ablation[key] == summary[key], key
    assert ablation["search"] is False and ablation["rl_steps"] == 2
    assert ablation["sft_seconds"] == 0.0  # it trained no SFT of its own


def test_the_demo_runs_the_fit_users_run_stopped_by_its_callback(tmp_path, monkeypatch):
    """SFT and GRPO each go through ``RunLoop.run`` (no loop of the demo's own), and reaching
    the target stops GRPO through ``on_step_end``: validated, checkpointed and exported."""
    from lmrl.run.loop import RunLoop

    runs, real_run = [], RunLoop.run

    def counted(loop):
        runs.append((type(loop.program).__name__, loop.on_step_end is not None))
        return real_run(loop)

    monkeypatch.setattr(RunLoop, "run", counted)
    summary = run_demo(tmp_path / "demo", fast=True, rl_steps=4, console=False)
    assert runs == [("SFTTrainer", True), ("Trainer", True)]
    assert summary["rl_steps"] == 2  # the fast demo caps GRPO at 2 steps
    assert (tmp_path / "demo" / "rl" / "final" / "config.json").is_file()
    assert (tmp_path / "demo" / "sft" / "final" / "config.json").is_file()

    from lmrl.demos.digits import run_rl

    data = {k: tmp_path / "demo" / "data" / f"{k}.parquet" for k in ("train", "test")}
    rl = run_rl(summary["sft_model"], data, tmp_path / "again", seed=0, steps=50, lr=1e-3,
                prompts_per_step=4, n=2, max_response_length=8, test_freq=1, target_acc=0.0,
                console=False)  # fmt: skip
    assert rl["steps"] == 1 and runs[-1] == ("Trainer", True)  # reached at the first check
    assert (tmp_path / "again" / "global_step_1" / "manifest.json").is_file()
    assert (tmp_path / "again" / "final" / "config.json").is_file()


def test_a_signal_during_grpo_stops_the_demo_with_its_exit_code(tmp_path, monkeypatch, capsys):
    """SIGTERM while GRPO runs: the run saves, and ``lmrl demo`` says in one line where it
    stopped and exits 143, without the finished demo's summary (no summary, no plot)."""
    import os
    import signal

    from lmrl.cli import main
    from lmrl.run.loop import RunLoop

    real_run = RunLoop.run

    def terminated(loop):
        if type(loop.program).__name__ == "Trainer":

            def on_step_end(step, metrics, real=loop.on_step_end):
                os.kill(os.getpid(), signal.SIGTERM)  # as `kill PID` would, mid-run
                return real(step, metrics)

            loop.on_step_end = on_step_end
        return real_run(loop)

    monkeypatch.setattr(RunLoop, "run", terminated)
    out = tmp_path / "demo"
    assert main(["demo", "--fast", "--out", str(out)]) == 143
    captured = capsys.readouterr()
    assert "lmrl demo: stopped by SIGTERM during GRPO after step 1 (its checkpoint is in " in (
        captured.err
    )
    assert "lmrl demo finished" not in captured.out
    assert (out / "rl" / "global_step_1").is_dir() and not (out / "rl" / "plot.png").exists()
