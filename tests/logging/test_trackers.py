"""Trackers: JSONL content and resume, console lines, optional backends, errors."""

from __future__ import annotations

import io
import json
import logging
import math
import sys
from pathlib import Path

import pytest

from lmrl.logging import (
    ConsoleTracker,
    JsonlTracker,
    MultiTracker,
    TrackerUnavailableError,
    make_trackers,
    summarize,
)
from lmrl.logging.console import format_duration
from lmrl.logging.trackers import flatten_config, mlflow_metric_name

STEP = {
    "critic/score/mean": 0.40625,
    "reward/acc/mean": 0.25,
    "response_length/mean": 7.25,
    "actor/kl_loss": 0.0012,
    "actor/ppo_kl": 3e-05,
    "actor/entropy": 2.3125,
    "actor/pg_clipfrac": 0.015625,
    "actor/pg_loss": -0.5,
    "timing_s/step": 1.3125,
}
CONFIG = {"actor": {"optim": {"lr": 1e-3}, "clip_ratio": 0.2}, "trainer": {"logger": ["jsonl"]}}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_stdlib_logging_is_not_shadowed():
    import lmrl.logging.factory as factory
    import lmrl.logging.plot as plot

    assert factory.logging is logging and plot.logging is logging
    assert hasattr(logging, "getLogger") and "lmrl" not in logging.__file__


# ------------------------------------------------------------------------------- jsonl
def test_jsonl_writes_one_object_per_step(tmp_path):
    tracker = JsonlTracker(tmp_path)
    tracker.log({"a/b": 1, "c": 0.5}, step=1)
    tracker.log({"a/b": 2.0, "nan": math.nan, "inf": math.inf}, step=2)
    tracker.close()
    raw = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert "NaN" not in raw[1] and "Infinity" not in raw[1]  # strict JSON
    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 1, "a/b": 1.0, "c": 0.5},
        {"step": 2, "a/b": 2.0, "nan": None, "inf": None},
    ]


def test_jsonl_rejects_non_numbers_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match="'a/b'"):
        JsonlTracker(tmp_path).log({"a/b": "high"}, step=1)


def test_jsonl_generations(tmp_path):
    tracker = JsonlTracker(tmp_path)
    rows = [
        {"prompt": "reverse 123", "response": "321", "score": 1.0, "data_source": "digits"},
        {"prompt": "reverse 45", "response": "5\n4", "score": 0.0, "data_source": "digits"},
    ]
    tracker.log_generations(rows, step=3)
    tracker.log_generations([], step=4)
    tracker.log_generations([{"prompt": "p", "response": "r", "score": math.nan}], step=5)
    got = read_jsonl(tmp_path / "generations.jsonl")
    assert got[:2] == [{"step": 3, **row} for row in rows]
    assert got[2] == {"step": 5, "prompt": "p", "response": "r", "score": None}
    assert len(got) == 3


def test_jsonl_fresh_run_starts_empty_and_resume_drops_later_steps(tmp_path):
    tracker = JsonlTracker(tmp_path)
    for step in range(1, 6):
        tracker.log({"x": step}, step)
        tracker.log_generations([{"response": str(step)}], step)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "x"')  # a write cut short by SIGKILL

    JsonlTracker(tmp_path, start_step=3).log({"x": 40.0}, 4)  # resumed from the step-3 ckpt
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["x"] == 40.0
    assert [r["step"] for r in read_jsonl(tmp_path / "generations.jsonl")] == [1, 2, 3]

    JsonlTracker(tmp_path, start_step=0)
    assert not (tmp_path / "metrics.jsonl").exists()
    assert not (tmp_path / "generations.jsonl").exists()


# ----------------------------------------------------------------------------- console
def test_summarize_compact_line():
    line = summarize(STEP | {"val/digits/acc": 0.5, "val/digits/pass@4": 0.75})
    assert line == (
        "score 0.406  acc 0.25  len 7.25  kl 0.0012  ppo_kl 3e-05  entropy 2.31  "
        "clipfrac 0.0156  1.31s/step  val/digits acc 0.5 pass@4 0.75"
    )
    assert summarize({"actor/reward_kl_penalty": 0.5}) == "kl 0.5"
    assert summarize({"other/key": 1.0}) == ""


def test_console_plain_lines_when_not_a_tty(capsys):
    tracker = ConsoleTracker(total_steps=4)
    assert not tracker.live  # capsys's stdout is not a terminal
    tracker.log(STEP, step=1)
    tracker.log({"val/digits/acc": 0.5}, step=1)
    tracker.log_generations([{"prompt": "p"}] * 3, step=1)
    tracker.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("step 1/4  score 0.406  acc 0.25  len 7.25  kl 0.0012")
    assert "clipfrac 0.0156  1.31s/step" in lines[0]
    assert lines[0].split("  eta ")[1].count(":") == 2  # an H:MM:SS estimate
    assert lines[1].startswith("step 1/4  val/digits acc 0.5")
    assert lines[2] == "step 1  3 generations logged"
    assert "\x1b[" not in "".join(lines)  # no ANSI codes in CI logs


def test_console_progress_bar_on_a_terminal():
    buf = io.StringIO()
    tracker = ConsoleTracker(total_steps=2, file=buf, force_terminal=True)
    assert tracker.live
    tracker.log(STEP, step=1)
    tracker.log(STEP, step=2)
    tracker.close()
    out = buf.getvalue()
    assert "step 2/2  score 0.406" in out
    assert "2/2" in out and "eta" in out  # the bar's step count and ETA column


def test_format_duration():
    assert format_duration(3725.4) == "1:02:05"
    assert format_duration(math.nan) == "-:--:--"


# ---------------------------------------------------------------------------- factory
def test_make_trackers_jsonl_always_first(tmp_path, capsys):
    trackers = make_trackers(["console"], tmp_path, total_steps=2)
    assert trackers.names == ["jsonl", "console"]
    with trackers:
        trackers.log(STEP, step=1)
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, **STEP}]
    assert "step 1/2" in capsys.readouterr().out
    assert make_trackers([], tmp_path).names == ["jsonl"]
    assert make_trackers(["jsonl", "console", "jsonl"], tmp_path).names == ["jsonl", "console"]


def test_make_trackers_unknown_name_lists_valid(tmp_path):
    with pytest.raises(ValueError, match=r"'tensorbord'.*valid: console, jsonl, tensorboard"):
        make_trackers(["console", "tensorbord"], tmp_path)


@pytest.mark.parametrize(("name", "module"), [("tensorboard", "tensorboard"), ("wandb", "wandb"),
                                              ("mlflow", "mlflow")])  # fmt: skip
def test_missing_package_gives_install_hint_at_construction(tmp_path, monkeypatch, name, module):
    # None in sys.modules makes `import module` fail as if it were not installed; the other
    # imports (torch.utils.tensorboard, already loaded) still succeed, so the check must be ours
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(TrackerUnavailableError, match=rf"pip install 'lmrl\[tracking\]'.*{module}"):
        make_trackers(["console", name], tmp_path)


def test_multi_tracker_closes_all_even_when_one_fails():
    closed = []

    class Boom(ConsoleTracker):
        def close(self):
            closed.append("boom")
            raise RuntimeError("boom")

    class Ok(ConsoleTracker):
        def close(self):
            closed.append("ok")

    with pytest.raises(RuntimeError, match="boom"):
        MultiTracker([Boom(file=io.StringIO()), Ok(file=io.StringIO())]).close()
    assert closed == ["boom", "ok"]


def test_flatten_config_and_mlflow_names():
    assert flatten_config(CONFIG) == {
        "actor.optim.lr": 1e-3,
        "actor.clip_ratio": 0.2,
        "trainer.logger": ["jsonl"],
    }
    assert mlflow_metric_name("val/digits/pass@4") == "val/digits/pass_at_4"
    assert mlflow_metric_name("val/openai/gsm8k/mean@1") == "val/openai/gsm8k/mean_at_1"
    assert mlflow_metric_name("a(b)") == "a_b_"


# ------------------------------------------------------------------ optional backends
def test_tensorboard_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = make_trackers(["tensorboard"], tmp_path, config_dict=CONFIG)
    trackers.log(STEP | {"x": math.nan}, step=1)
    trackers.log(STEP | {"critic/score/mean": 0.75}, step=2)
    trackers.log_generations([{"prompt": "a|b", "response": "c", "score": 1.0}], step=2)
    trackers.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("critic/score/mean")] == [(1, 0.40625),
                                                                             (2, 0.75)]  # fmt: skip
    assert "x" not in acc.Tags()["scalars"]  # non-finite values are skipped


def test_wandb_offline_writes_into_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "")
    monkeypatch.delenv("WANDB_MODE")  # unset, and restored after the test
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = make_trackers(["wandb"], tmp_path, "proj", "exp", config_dict=CONFIG)
    trackers.log(STEP, step=1)
    trackers.log_generations([{"prompt": "p", "response": "r", "score": 1.0}], step=1)
    trackers.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb"))  # the run's offline record, for `wandb sync`


def test_mlflow_local_store_in_run_dir(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):  # restored after the test
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    from mlflow.tracking import MlflowClient

    trackers = make_trackers(["mlflow"], tmp_path, "proj", "exp", config_dict=CONFIG)
    trackers.log(STEP | {"val/digits/pass@4": 0.5}, step=1)
    trackers.log({"critic/score/mean": 0.75}, step=2)
    trackers.log_generations([{"prompt": "p", "response": "r", "score": 1.0}], step=2)
    trackers.close()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run = client.search_runs([client.get_experiment_by_name("proj").experiment_id])[0]
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    assert run.data.params["actor.optim.lr"] == "0.001"
    assert run.data.metrics["val/digits/pass_at_4"] == 0.5
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.40625), (2, 0.75)]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "generations")] == [
        "generations/step_0000002.jsonl"
    ]
