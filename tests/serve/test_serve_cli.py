"""``lmrl serve``: a model directory, a run's final model or a checkpoint behind the endpoint,
served until SIGTERM or Ctrl-C, exiting cleanly."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from lmrl.cli.commands import _servable  # noqa: E402
from lmrl.errors import CheckpointError  # noqa: E402


def read_until(proc, prefix: str, timeout: float = 120.0) -> tuple[str, list[str]]:
    """The first stdout line starting with ``prefix`` (its rest) and the lines before it."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line.rstrip("\n"))
        if line.startswith(prefix):
            return line[len(prefix) :].strip(), seen
    raise AssertionError(f"no {prefix} line; output: {seen}; stderr: {proc.stderr.read()}")


def test_lmrl_serve_answers_the_openai_client_and_stops_on_sigterm(tiny_workspace):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lmrl.cli", "serve", str(tiny_workspace / "model"),
               "--port", "0", "--model-name", "tiny", "--device", "cpu"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    try:
        url, lines = read_until(proc, "OPENAI_BASE_URL=")
        key, _ = read_until(proc, "OPENAI_API_KEY=")
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        assert "the model" in lines[0]
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
        out = client.chat.completions.create(model="tiny", messages=[
            {"role": "user", "content": "hi"}], max_tokens=3)  # fmt: skip
        assert out.choices[0].message.content is not None
        bad = openai.OpenAI(base_url=url, api_key="wrong", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert stdout.strip().endswith("stopped")
    assert "Traceback" not in stderr


def test_what_lmrl_serve_loads_from_a_path(tiny_workspace, tmp_path):
    import torch
    from safetensors.torch import save_file

    from lmrl.models.loading import load_causal_lm

    model = tiny_workspace / "model"
    assert _servable(model)[:2] == (str(model), None)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"model:\n  path: {model}\n")
    with pytest.raises(CheckpointError, match="no final model and no checkpoint"):
        _servable(run)
    # a checkpoint: the run's model.path with the checkpoint's actor weights over it
    step = run / "global_step_3"
    step.mkdir()
    lm = load_causal_lm(model)
    state = {k: v + 1.0 for k, v in lm.state_dict().items() if k != "lm_head.weight"}
    save_file(state, step / "actor.safetensors")
    path, load, what = _servable(step)
    assert path == str(model) and "global_step_3" in what
    fresh = load_causal_lm(path)
    load(fresh)
    name = "model.norm.weight"
    assert torch.equal(fresh.state_dict()[name], state[name])
    # a run's final model comes first
    shutil.copytree(model, run / "final")
    assert _servable(run)[:2] == (str(run / "final"), None)
    with pytest.raises(CheckpointError, match="neither a model directory"):
        _servable(tmp_path)
    (run / "config.yaml").write_text(f"model:\n  path: {model}\n  lora_rank: 8\n")
    with pytest.raises(CheckpointError, match="LoRA"):
        _servable(step)
