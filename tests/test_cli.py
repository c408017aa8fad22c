"""The ``lmrl`` command line: what it prints and how it exits.

An input the user can fix (an ``LmrlError``) ends in one line and exit 2; Ctrl-C before a
command handles it ends in one line and exit 130; anything else is a bug and keeps its
traceback (exit 1). The bad-input table runs each wrong input of issue 18 through ``main``:
the input, the exit code, the message fragments (and what the message must not say), and
the files that must be left as they were.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from lmrl.cli import main
from lmrl.data.tasks import write_task
from lmrl.errors import DataError
from lmrl.models.tiny import build_tiny_model

LMRL = Path(sys.executable).parent / "lmrl"


def run(argv: list[str], capsys, caplog) -> tuple[int, str, str]:
    """``main(argv)`` in-process: the exit code, stderr, and stderr with the log records."""
    caplog.clear()
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    return code, err, err + caplog.text


def run_process(argv: list[str], code: str | None = None) -> subprocess.CompletedProcess:
    """``lmrl argv`` as a real process, or ``python -c code`` when ``code`` is given."""
    command = [sys.executable, "-c", code] if code else [str(LMRL), *map(str, argv)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


# ------------------------------------------------------------------ how each kind of error ends
@pytest.fixture
def failing_write_task(monkeypatch):
    """``failing_write_task(exc)``: ``lmrl tasks digits`` raises ``exc`` from inside the command."""

    def install(exc: BaseException) -> None:
        def write_task(*args, **kwargs):
            raise exc

        monkeypatch.setattr("lmrl.data.tasks.write_task", write_task)

    return install


def test_an_lmrl_error_is_one_line_and_exit_2(tmp_path, capsys, failing_write_task):
    failing_write_task(DataError("train.jsonl: row 3: column 'prompt': empty prompt"))
    assert main(["tasks", "digits", "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err == "lmrl tasks: error: train.jsonl: row 3: column 'prompt': empty prompt\n"
    assert captured.out == ""


@pytest.mark.parametrize("exc", [RuntimeError("a bug"), ValueError("shapes (2, 3) and (3, 2)")])
def test_any_other_error_propagates(tmp_path, capsys, failing_write_task, exc):
    """A plain ValueError is a bug too (a shape check deep in a step), not a typo."""
    failing_write_task(exc)
    with pytest.raises(type(exc), match=str(exc).replace("(", r"\(").replace(")", r"\)")):
        main(["tasks", "digits", "--out", str(tmp_path)])
    assert capsys.readouterr().err == ""


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys, failing_write_task):
    failing_write_task(KeyboardInterrupt())
    assert main(["tasks", "digits", "--out", str(tmp_path)]) == 130
    assert capsys.readouterr().err == "lmrl tasks: interrupted\n"


PATCHED_RUN = """
import sys
import lmrl.data.tasks

def write_task(*args, **kwargs):
    raise {exc}

lmrl.data.tasks.write_task = write_task
from lmrl.cli import main
sys.exit(main(["tasks", "digits", "--out", {out!r}]))
"""


def test_a_bug_in_a_process_exits_1_with_its_traceback(tmp_path):
    code = textwrap.dedent(PATCHED_RUN).format(exc="RuntimeError('a bug')", out=str(tmp_path))
    done = run_process([], code)
    assert done.returncode == 1
    assert "Traceback (most recent call last)" in done.stderr
    assert "RuntimeError: a bug" in done.stderr and "in write_task" in done.stderr


def test_ctrl_c_in_a_process_exits_130_without_a_traceback(tmp_path):
    code = textwrap.dedent(PATCHED_RUN).format(exc="KeyboardInterrupt", out=str(tmp_path))
    done = run_process([], code)
    assert (done.returncode, done.stderr) == (130, "lmrl tasks: interrupted\n")


# ------------------------------------------------------------------ the bad-input table
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    return write_task("digits", tmp_path_factory.mktemp("digits"), num_train=8, num_test=4)["train"]


@pytest.fixture
def files(tmp_path, model_dir, train_file) -> dict[str, Path]:
    """The inputs the rows name, made fresh in ``tmp_path``: ``{NAME}`` in a row is one of these."""
    final = tmp_path / "RUN" / "final"  # a trained model, e.g. an SFT run's output
    shutil.copytree(model_dir, final)
    truncated = tmp_path / "truncated"
    shutil.copytree(model_dir, truncated)
    weights = truncated / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    latin1 = tmp_path / "latin1.jsonl"
    rows = ['{"prompt": "reverse 12", "data_source": "digits"}', '{"prompt": "r\xe9verse 3"}']
    latin1.write_bytes("\n".join(rows).encode("latin-1") + b"\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me\n")
    return {
        "MODEL": model_dir,
        "DATA": train_file,
        "FINAL": final,
        "TRUNCATED": truncated,
        "LATIN1": latin1,
        "NOTES": notes,
        "RUN": tmp_path / "run",
    }


def train(*overrides: str) -> list[str]:
    """``lmrl train`` with a valid small run around ``overrides``."""
    return [
        "train",
        "model.path={MODEL}",
        "data.train_files={DATA}",
        "data.train_batch_size=4",
        "actor.ppo_mini_batch_size=4",
        "trainer.default_local_dir={RUN}",
        *overrides,
    ]


@dataclass(frozen=True)
class Row:
    """One wrong input.

    Attributes:
        id: the test id.
        argv: the command line, ``{NAME}`` standing for a path of the ``files`` fixture.
        code: the exit code.
        says: fragments the output (stderr and log) must contain.
        not_says: fragments it must not contain.
        intact: ``files`` names whose content must be unchanged (a file, or a whole directory).
    """

    id: str
    argv: list[str]
    code: int
    says: tuple[str, ...]
    not_says: tuple[str, ...] = ()
    intact: tuple[str, ...] = ()


TABLE = [
    Row(
        "truncated-safetensors",
        train("model.path={TRUNCATED}"),
        2,
        ("lmrl train: error:", "{TRUNCATED}/model.safetensors is damaged or truncated"),
        intact=("TRUNCATED",),
    ),
    Row(
        "tasks-out-is-a-file",
        ["tasks", "digits", "--out", "{NOTES}"],
        2,
        ("lmrl tasks: error: {NOTES} is a file, not a directory",),
        not_says=("FileExistsError",),
        intact=("NOTES",),
    ),
    Row(
        "jsonl-not-utf8",
        train("data.train_files={LATIN1}"),
        2,
        ("lmrl train: error: {LATIN1}: line 2: byte 0xe9 at column 14 is not UTF-8",),
        intact=("LATIN1",),
    ),
    Row(
        "vllm-without-the-extra",
        train("actor_rollout_ref.rollout.name=vllm"),
        2,
        (
            "rollout.name=vllm needs vLLM, which is not installed",
            "make vllm-cpu-env",
            "rollout.name=hf",
        ),
    ),
    Row(
        "ray-mini-batch-smaller-than-the-workers",
        train("trainer.backend=ray", "resources.n_gpus_per_node=3"),
        2,
        ("cannot be shared evenly by 3 workers",),
    ),
    Row(
        "tiny-model-over-a-trained-model",
        ["tiny-model", "{FINAL}", "--seed", "7"],
        2,
        ("lmrl tiny-model: error: {FINAL} is not empty", "--force"),
        intact=("FINAL",),
    ),
    Row(  # a notice, not an error: the run would go on; trainer.total_epochs=0 stops it here
        "kl-loss-coef-without-the-kl-loss",
        train("actor_rollout_ref.actor.kl_loss_coef=0.001", "trainer.total_epochs=0"),
        2,
        (
            "actor_rollout_ref.actor.kl_loss_coef=0.001 changes nothing: actor.use_kl_loss=false",
            "lmrl train: error: trainer.total_epochs=0 must be >= 1",
        ),
    ),
    Row(
        "derived-gen-batch-size-not-named",
        train("data.train_batch_size=0"),
        2,
        ("lmrl train: error: data.train_batch_size=0 must be >= 1",),
        not_says=("gen_batch_size", "config errors"),
    ),
    Row(
        "derived-critic-keys-not-named-in-grpo",
        train("algorithm.adv_estimator=grpo", "rollout.n=2", "actor.ppo_epochs=0"),
        2,
        ("lmrl train: error: actor.ppo_epochs=0 must be >= 1",),
        not_says=("critic.", "config errors"),
    ),
]


def fill(text: str, files: dict[str, Path]) -> str:
    return text.format(**{k: str(v) for k, v in files.items()})


def snapshot(path: Path) -> dict[str, bytes]:
    """The bytes of ``path``, or of every file under it."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {
        str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()
    }


@pytest.fixture
def no_vllm(monkeypatch):
    """vLLM not installed, whatever this machine has."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )


@pytest.mark.parametrize("row", TABLE, ids=[r.id for r in TABLE])
def test_bad_input(row, files, capsys, caplog, no_vllm):
    before = {name: snapshot(files[name]) for name in row.intact}
    code, err, output = run([fill(a, files) for a in row.argv], capsys, caplog)
    assert code == row.code, output
    for fragment in row.says:
        assert fill(fragment, files) in output, output
    for fragment in row.not_says:
        assert fill(fragment, files) not in output, output
    assert "Traceback" not in output
    assert err.count("\n") == 1, err  # one line: notices and logs go to the log
    for name in row.intact:
        assert snapshot(files[name]) == before[name], f"{name} changed"
    assert not (files["RUN"] / "config.yaml").exists()  # no run was started


@pytest.mark.skipif(not LMRL.exists(), reason="the lmrl script is not installed")
@pytest.mark.parametrize("row_id", ["tasks-out-is-a-file", "truncated-safetensors"])
def test_bad_input_in_a_process(row_id, files):
    """The installed ``lmrl`` exits with the table's code and one line, no traceback."""
    row = next(r for r in TABLE if r.id == row_id)
    before = {name: snapshot(files[name]) for name in row.intact}
    done = run_process([fill(a, files) for a in row.argv])
    assert done.returncode == row.code, done.stderr
    assert "Traceback" not in done.stderr
    logged = ("INFO ", "WARNING ")  # the run's log lines, if any came before the error
    lines = [line for line in done.stderr.splitlines() if not line.startswith(logged)]
    assert len(lines) == 1 and fill(row.says[-1], files) in lines[0], done.stderr
    for name in row.intact:
        assert snapshot(files[name]) == before[name]
