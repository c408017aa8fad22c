"""Test-wide settings: never reach a model hub, keep caches in a temp dir, two threads, and
every `Batch` key checked against its schema."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
if "HF_HOME" not in os.environ:  # a fresh cache dir, removed when the session ends
    os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="lmrl-hf-home-")
    atexit.register(shutil.rmtree, os.environ["HF_HOME"], ignore_errors=True)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("LMRL_STRICT_BATCH", "1")  # a Batch refuses keys lmrl.batch.schema lacks

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# two threads; one per process when pytest-xdist runs several (make test and test-learning: -n 2)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_workspace(tmp_path_factory):
    """A tiny Qwen2 model (``model/``) and the digits task (``data/``: 16 train, 4 test rows),
    built once per session; tests write their runs elsewhere (``tmp_path``) or under their own
    names."""
    from lmrl.data.tasks import write_task
    from lmrl.models import build_tiny_model

    root = tmp_path_factory.mktemp("workspace")
    build_tiny_model(root / "model", arch="qwen2", size="tiny", seed=0)
    write_task("digits", root / "data", seed=0, num_train=16, num_test=4)
    return root


@pytest.fixture
def two_ray_nodes():
    """A head and a second node started with ``ray start`` on this machine, 1 CPU each.

    Asked for 127.0.0.1, Ray advertises the machine's own address: its single-machine
    (loopback-only) mode refuses a second node. The traffic stays on this machine either way.
    Every server binds a port the system picks (the head's GCS too, read back from ``ray
    start``): a port found free can be taken before the GCS binds it, and Ray's fixed defaults
    (workers on 10002-19999, the agents' 52365) are shared with any other Ray of the machine.
    Both nodes take this process's ``RAY_AUTH_MODE`` (its driver joins them), ``disabled``
    when unset: a head turns token authentication on by itself where ``~/.ray/auth_token``
    exists (a local ``ray.init`` writes it, in this test run or a parallel one), a joining node
    does not, and is refused.
    """
    from lmrl.workers.ray_cluster import kill_processes, ray_processes

    temp_dir = f"/tmp/lmrl-ray-2n-{os.getpid()}"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.setdefault("RAY_AUTH_MODE", "disabled")
    ray_bin = str(Path(sys.executable).with_name("ray"))
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0",
              "--disable-usage-stats", "--min-worker-port=0", "--max-worker-port=0",
              "--dashboard-agent-listen-port=0"]  # fmt: skip
    try:
        head = ray_start([ray_bin, "start", "--head", "--port=0", f"--temp-dir={temp_dir}",
                          "--include-dashboard=false", *common], env)  # fmt: skip
        port = ray_start_port(head)
        ray_start([ray_bin, "start", f"--address=127.0.0.1:{port}", *common], env)
        yield f"127.0.0.1:{port}", temp_dir
    finally:
        # never `ray stop`: it would stop every Ray process of the machine
        kill_processes(temp_dir)
        deadline = time.monotonic() + 30
        while ray_processes(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.3)


def ray_start(command: list[str], env: dict[str, str]) -> str:
    """Run ``ray start ...``; its output, or an error ending with it."""
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120,
                          check=False)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(command[1:3])} failed: {output[-3000:]}"
    return output


def ray_start_port(output: str) -> int:
    """The GCS port of a head started with ``ray start --head --port=0``: Ray prints the
    command that joins it (``ray start --address='<ip>:<port>'``)."""
    import re

    found = re.search(r"ray start --address='[^']*:(\d+)'", output)
    assert found, f"no address in the output of ray start: {output[-2000:]}"
    return int(found.group(1))


def build_search_caller(out_dir):
    """A tiny Qwen2 made into a bigram model that writes ``<search>x</search>`` (or the
    malformed ``</search>``) over and over: every layer's output projections are zeroed, so
    the hidden state is the current token's embedding, and the untied head maps a few byte
    tokens to their successor in that text (``<`` to ``s`` or ``/`` with equal odds) and
    every other token to ``<``. Tests of multi-turn runs need a policy that calls a tool
    within a few tokens; a random one practically never writes a closing tag."""
    import torch
    from transformers import AutoModelForCausalLM

    from lmrl.models.tiny import save_model, tiny_config

    config = tiny_config("qwen2", "tiny")
    config.tie_word_embeddings = False
    out = save_model(config, out_dir, seed=0)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    nxt = {"<": "s/", "s": "e", "e": "a", "a": "r", "r": "c", "c": "h", "h": ">", ">": "x",
           "x": "<", "/": "s"}  # fmt: skip
    chars = list(nxt)
    hidden = config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        emb.zero_()
        emb[:, len(chars)] = 1.0  # "any other token"
        for dim, ch in enumerate(chars):
            emb[ord(ch)].zero_()
            emb[ord(ch), dim] = 1.0
        head = model.lm_head.weight
        head.zero_()
        for dim, ch in enumerate(chars):
            for succ in nxt[ch]:
                head[ord(succ), dim] = 2.0  # RMSNorm scales the one-hot to sqrt(hidden)
        head[ord("<"), len(chars)] = 2.0
        assert len(chars) < hidden
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def search_workspace(tmp_path_factory):
    """``model/`` (`build_search_caller`) and the search_qa task (``data/``: 16 train and 4
    test questions, ``corpus.parquet``), built once per session."""
    from lmrl.data.tasks import write_task

    root = tmp_path_factory.mktemp("search-workspace")
    build_search_caller(root / "model")
    write_task("search_qa", root / "data", seed=0, num_train=16, num_test=4)
    return root


@pytest.fixture(scope="session")
def search_caller():
    """`build_search_caller`, for tests that build the model where they need it."""
    return build_search_caller
