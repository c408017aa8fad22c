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

# two threads; one per process when pytest-xdist runs several (make test-learning: -n 2)
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
    """
    from lmrl.workers.ray_cluster import free_port, kill_processes, ray_processes

    port = free_port()
    temp_dir = f"/tmp/lmrl-ray-2n-{os.getpid()}"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    ray_bin = str(Path(sys.executable).with_name("ray"))
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0",
              "--disable-usage-stats"]  # fmt: skip
    subprocess.run(
        [ray_bin, "start", "--head", f"--port={port}", f"--temp-dir={temp_dir}",
         "--include-dashboard=false", *common],
        check=True, env=env, capture_output=True, timeout=120,
    )  # fmt: skip
    try:
        subprocess.run(
            [ray_bin, "start", f"--address=127.0.0.1:{port}", *common],
            check=True, env=env, capture_output=True, timeout=120,
        )  # fmt: skip
        yield f"127.0.0.1:{port}", temp_dir
    finally:
        # never `ray stop`: it would stop every Ray process of the machine

        kill_processes(temp_dir)
        deadline = time.monotonic() + 30
        while ray_processes(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.3)


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
