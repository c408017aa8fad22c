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
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "syntax.py").write_text("def compute_score(:\n")
    (tmp_path / "nofn.py").write_text("def other(data_source, solution_str):\n    return 1.0\n")
    (tmp_path / "bad.yaml").write_text("actor: {clip_ratio: [0.2\n")
    (tmp_path / "list.yaml").write_text("- actor\n- critic\n")
    (tmp_path / "dup.yaml").write_text(
        "actor:\n  clip_ratio: 0.3\ndata: {}\nactor:\n  ppo_epochs: 2\n"
    )
    (tmp_path / "train.csv").write_text("prompt\nhello\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["2+2?"], "data_source": ["digits"]}),
                   tmp_path / "noprompt.parquet")  # fmt: skip
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "none.parquet")
    return {
        "EMPTY": empty,
        "SYNTAX": tmp_path / "syntax.py",
        "NOFN": tmp_path / "nofn.py",
        "BADYAML": tmp_path / "bad.yaml",
        "LISTYAML": tmp_path / "list.yaml",
        "DUPYAML": tmp_path / "dup.yaml",
        "CSV": tmp_path / "train.csv",
        "NOPROMPT": tmp_path / "noprompt.parquet",
        "NOROWS": tmp_path / "none.parquet",
        "MISSING": tmp_path / "missing",
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
    # ---- the sweep of issue 16: what a new user meets, each one line naming the fix
    Row(
        "model-path-missing",
        train("model.path={MISSING}"),
        2,
        ("model path '{MISSING}' does not exist",),
    ),
    Row(
        "model-path-is-a-file",
        train("model.path={NOTES}"),
        2,
        ("'{NOTES}' is a file; expected a model directory",),
        intact=("NOTES",),
    ),
    Row(
        "model-dir-without-config",
        train("model.path={EMPTY}"),
        2,
        ("without a config.json", "lmrl tiny-model"),
    ),
    Row(
        "model-path-not-set",
        ["train", "data.train_files={DATA}"],
        2,
        ("model.path is not set", "actor_rollout_ref.model.path"),
    ),
    Row(
        "data-missing",
        train("data.train_files={MISSING}.parquet"),
        2,
        ("data file {MISSING}.parquet does not exist",),
    ),
    Row(
        "data-csv",
        train("data.train_files={CSV}"),
        2,
        ("unsupported data file type '.csv'", ".parquet"),
        intact=("CSV",),
    ),
    Row(
        "data-without-a-prompt-column",
        train("data.train_files={NOPROMPT}"),
        2,
        ("column 'prompt': missing", "'question'"),
    ),
    Row("data-without-rows", train("data.train_files={NOROWS}"), 2, ("no rows in",)),
    Row(
        "val-data-missing",
        train("data.val_files={MISSING}.parquet"),
        2,
        ("data file {MISSING}.parquet does not exist",),
    ),
    Row(
        "reward-file-missing",
        train("reward.custom_reward_function.path={MISSING}.py"),
        2,
        ("custom reward function file {MISSING}.py does not exist",),
    ),
    Row(
        "reward-file-syntax-error",
        train("reward.custom_reward_function.path={SYNTAX}"),
        2,
        ("SyntaxError", "syntax.py, line 1"),
        intact=("SYNTAX",),
    ),
    Row(
        "reward-function-misnamed",
        train("reward.custom_reward_function.path={NOFN}"),
        2,
        ("'compute_score' not found", "callables there: ['other']"),
        intact=("NOFN",),
    ),
    Row(
        "scorer-option-unknown",
        train("reward.scorer_options.digits.exact=true"),
        2,
        (
            "reward.scorer_options.digits.exact: the digits scorer has no option 'exact'",
            "its options: binary",
        ),
    ),
    Row(
        "unknown-key",
        train("actor.clip_ratoi=0.2"),
        2,
        ("unknown key 'actor.clip_ratoi'; did you mean 'actor.clip_ratio'?",),
    ),
    Row(
        "wrong-type",
        train("actor.optim.lr=abc"),
        2,
        ("actor.optim.lr: expected a number, got 'abc'",),
    ),
    Row("unknown-estimator", train("algorithm.adv_estimator=grpoo"), 2, ("did you mean 'grpo'?",)),
    Row(
        "unknown-loss-aggregation",
        train("actor.loss_agg_mode=mean"),
        2,
        ("not a loss aggregation mode", "token-mean"),
    ),
    Row("zero-samples", train("rollout.n=0"), 2, ("rollout.n=0 must be >= 1",)),
    Row(
        "zero-response-length",
        train("data.max_response_length=0"),
        2,
        ("data.max_response_length=0 must be >= 1",),
    ),
    Row(
        "mini-batch-larger-than-the-batch",
        train("actor.ppo_mini_batch_size=8"),
        2,
        ("actor.ppo_mini_batch_size=8 is larger than data.train_batch_size=4",),
    ),
    Row(
        "sampling-at-temperature-0",
        train("rollout.temperature=0"),
        2,
        ("rollout.do_sample=false for greedy decoding",),
    ),
    Row("unknown-dtype", train("model.dtype=float8"), 2, ("did you mean 'float64'?",)),
    Row("negative-lora-rank", train("model.lora_rank=-1"), 2, ("model.lora_rank=-1 must be >= 0",)),
    Row(
        "unknown-logger",
        train("trainer.logger=[nonexistent]"),
        2,
        ("item 'nonexistent' is not one of console, jsonl",),
    ),
    Row(
        "negative-steps",
        train("trainer.total_training_steps=-5"),
        2,
        ("trainer.total_training_steps=-5 must be >= 1",),
    ),
    Row(
        "cuda-without-a-gpu",
        train("trainer.device=cuda"),
        2,
        ("CUDA is not available; use trainer.device=cpu",),
    ),
    Row(
        "reward-model-without-a-path",
        train("reward_model.enable=true"),
        2,
        ("reward_model.model.path=",),
    ),
    Row(
        "override-without-equals",
        train("actor.clip_ratio"),
        2,
        ("override 'actor.clip_ratio' is not key=value",),
    ),
    Row(
        "config-file-missing",
        ["train", "--config", "{MISSING}.yaml"],
        2,
        ("config file {MISSING}.yaml does not exist",),
    ),
    Row(
        "config-file-bad-yaml",
        ["train", "--config", "{BADYAML}"],
        2,
        ("is not valid YAML: line 2, column 1",),
        intact=("BADYAML",),
    ),
    Row(
        "config-file-a-list",
        ["train", "--config", "{LISTYAML}"],
        2,
        ("must hold a mapping of sections", "got a list"),
    ),
    Row(
        "run-dir-is-a-file",
        train("trainer.default_local_dir={NOTES}"),
        2,
        ("{NOTES} is a file, not a directory",),
        intact=("NOTES",),
    ),
    Row(
        "run-dir-not-writable",
        train("trainer.default_local_dir=/proc/lmrl-run"),
        2,
        ("trainer.default_local_dir=/proc/lmrl-run is not writable",),
    ),
    Row(
        "resume-from-a-missing-checkpoint",
        train("trainer.resume_mode=resume_path", "trainer.resume_from_path={MISSING}"),
        2,
        ("{MISSING}: does not exist", "global_step_N"),
    ),
    Row(
        "ray-address-nobody-answers",
        train("trainer.backend=ray", "resources.ray_address=127.0.0.1:1"),
        2,
        ("nothing answers there", "ray start --head"),
    ),
    Row(
        "eval-of-a-missing-run",
        ["eval", "{MISSING}"],
        2,
        ("neither a run directory with a checkpoint nor a checkpoint",),
    ),
    Row(
        "plot-of-a-directory-without-metrics", ["plot", "{EMPTY}"], 2, ("metrics.jsonl not found",)
    ),
    Row(
        "unknown-task",
        ["tasks", "digitz", "--out", "{MISSING}"],
        2,
        ("unknown task 'digitz'; tasks: add, arithmetic",),
    ),
    Row(
        "tiny-model-unknown-size",
        ["tiny-model", "{MISSING}", "--size", "huge"],
        2,
        ("size must be one of ['tiny', 'small', 'base']",),
    ),
    Row(
        "sft-without-data",
        ["sft", "model.path={MODEL}", "trainer.default_local_dir={RUN}"],
        2,
        ("data.train_files is not set",),
    ),
    Row(
        "sft-response-column-missing",
        [
            "sft",
            "model.path={MODEL}",
            "data.train_files={DATA}",
            "data.response_key=answerz",
            "trainer.default_local_dir={RUN}",
        ],
        2,
        ("neither a 'answerz' column (data.response_key)", "response_from_ground_truth"),
    ),
    Row(
        "derived-critic-keys-not-named-in-grpo",
        train("algorithm.adv_estimator=grpo", "rollout.n=2", "actor.ppo_epochs=0"),
        2,
        ("lmrl train: error: actor.ppo_epochs=0 must be >= 1",),
        not_says=("critic.", "config errors"),
    ),
    # issue 31 §3: --out never writes over a model or data unasked; pretrain-flow's and
    # tasks' arguments are checked (another command's run directory: tests/trainer/test_run_dirs.py)
    Row(
        "pretrain-flow-over-a-model",
        ["pretrain-flow", "{DATA}", "--out", "{FINAL}", "--steps", "1"],
        2,
        ("lmrl pretrain-flow: error: {FINAL} is not empty", "--force"),
        intact=("FINAL",),
    ),
    Row(
        "pretrain-flow-on-a-text-task",
        ["pretrain-flow", "{DATA}", "--out", "{MISSING}", "--steps", "1"],
        2,
        ("{DATA}: no column 'image', 'shape'", "not an images file", "lmrl tasks shapes"),
    ),
    Row(
        "pretrain-flow-not-a-parquet",
        ["pretrain-flow", "{NOTES}", "--out", "{MISSING}", "--steps", "1"],
        2,
        ("{NOTES}: not a readable parquet file", "lmrl tasks shapes"),
        intact=("NOTES",),
    ),
    Row(
        "pretrain-flow-zero-batch",
        ["pretrain-flow", "{DATA}", "--out", "{MISSING}", "--batch-size", "0"],
        2,
        ("lmrl pretrain-flow: error: --batch-size must be >= 1, got 0",),
    ),
    Row(
        "pretrain-flow-negative-lr",
        ["pretrain-flow", "{DATA}", "--out", "{MISSING}", "--lr", "-1"],
        2,
        ("lmrl pretrain-flow: error: --lr must be a number > 0, got -1.0",),
    ),
    Row(
        "pretrain-flow-caption-noise-above-one",
        ["pretrain-flow", "{DATA}", "--out", "{MISSING}", "--caption-noise", "1.5"],
        2,
        ("lmrl pretrain-flow: error: --caption-noise must be in [0, 1], got 1.5",),
    ),
    Row(
        "tasks-over-a-model",
        ["tasks", "digits", "--out", "{FINAL}"],
        2,
        ("lmrl tasks: error: {FINAL} is not empty", "--force to write the task over"),
        intact=("FINAL",),
    ),
    Row(
        "tasks-zero-train",
        ["tasks", "shapes", "--out", "{MISSING}", "--num-train", "0"],
        2,
        ("lmrl tasks: error: --num-train must be >= 1, got 0",),
    ),
    Row(
        "tasks-negative-test",
        ["tasks", "digits", "--out", "{MISSING}", "--num-test", "-3"],
        2,
        ("lmrl tasks: error: --num-test must be >= 1, got -3",),
    ),
    # issue 31 §4: what the backends accept (inert keys are notices: tests/config)
    Row(
        "config-file-section-twice",
        ["train", "--config", "{DUPYAML}", *train()[1:]],
        2,
        ("config file {DUPYAML}: 'actor' is written twice (lines 1 and 4)",),
        intact=("DUPYAML",),
    ),
    Row(
        "ray-zero-gpus-per-node",
        train("trainer.backend=ray", "resources.n_gpus_per_node=0"),
        2,
        ("resources.n_gpus_per_node=0 must be >= 1",),
    ),
    Row(
        "ray-negative-critic-workers",
        train("trainer.backend=ray", "resources.critic_workers=-1"),
        2,
        ("resources.critic_workers=-1 must be >= 0",),
    ),
    Row(
        "ray-address-is-the-dashboard",
        train("trainer.backend=ray", "resources.ray_address=http://127.0.0.1:8265"),
        2,
        ("is the URL of Ray's dashboard", "host:6379, ray://host:10001 (Ray Client) or auto"),
        not_says=("resolve", "nothing answers"),
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


def test_tiny_model_prints_next_commands_that_load(tmp_path, capsys):
    """The warm start and the RL run it suggests are valid configs (from-scratch settings)."""
    from lmrl.config import load_config
    from lmrl.config.sft import load_sft_config

    assert main(["tiny-model", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    commands = out.split("next:", 1)[1].replace("\\\n", " ").splitlines()
    sft = next(c for c in commands if c.strip().startswith("lmrl sft")).split()[2:]
    rl = next(c for c in commands if c.strip().startswith("lmrl train")).split()[2:]
    assert f"model.path={tmp_path / 'm'}" in sft and "optim.lr=1e-3" in sft
    assert load_sft_config(None, sft).optim.lr == 1e-3
    cfg = load_config(None, rl)
    assert cfg.actor.optim.lr == 1e-4 and cfg.data.max_response_length == 8
    assert cfg.rollout.temperature == 0.7


def test_pretrain_flow_help_shows_its_defaults(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["pretrain-flow", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal
    assert exit_.value.code == 0
    assert "(default: 400, as `lmrl demo --task flow` pre-trains)" in out
    assert "(default: 64)" in out and "(default: 0.002)" in out
    assert "(default: 0.0; `lmrl demo --task flow` uses 0.25)" in out


def test_eval_of_an_image_run_with_sampler_n_0_is_one_line(tmp_path, capsys):
    """``lmrl eval RUN sampler.n=0`` on an image run: the key's range in one line, before any
    model loads (the run here is its config and an empty checkpoint directory)."""
    from lmrl.config.flow import load_flow_config
    from lmrl.config.loader import save_config

    run = tmp_path / "run"
    cfg = load_flow_config(None, [
        f"model.path={tmp_path / 'model'}", f"data.train_files={tmp_path / 'p.txt'}",
        f"data.val_files={tmp_path / 'p.txt'}", f"trainer.default_local_dir={run}",
    ])  # fmt: skip
    save_config(cfg, run / "config.yaml", "lmrl train-flow")
    (run / "global_step_1").mkdir()
    assert main(["eval", str(run / "global_step_1"), "sampler.n=0"]) == 2
    err = capsys.readouterr().err
    assert "lmrl eval: error: sampler.n=0 must be >= 2" in err
    assert err.count("\n") == 1 and "Traceback" not in err
