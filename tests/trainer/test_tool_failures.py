"""Tools fail loudly in a real run (issue 31 §2): a broken retrieval server ends `lmrl train`
at start-up in one line; one that breaks after the start-up query ends it at its first batch;
a working one shows the step's tool errors on the console line."""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from lmrl.cli import main as cli_main


@contextlib.contextmanager
def retrieval_server(corpus, healthy_requests: float = math.inf, topk: int = 1) -> Iterator[str]:
    """Search-R1's server, answering from our BM25 tool over ``corpus``, that answers
    ``healthy_requests`` requests (the first is the start-up query), then HTTP 500 to every
    other; yields its URL."""
    from lmrl.tools import SearchTool

    tool = SearchTool(corpus, topk=topk)
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            if len(seen) > healthy_requests:
                self.send_error(500)
                return
            hits = tool.retrieve(body["queries"])
            result = [
                [{"document": {"contents": f"{p['title']}\n{p['text']}"}, "score": 1.0} for p in h]
                for h in hits
            ]
            data = json.dumps({"result": result}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/retrieve"
    finally:
        server.shutdown()
        server.server_close()


def train(workspace, run, url, *extra) -> int:
    """One GRPO step of the search caller (it calls search every few tokens), no validation."""
    return cli_main([
        "train", f"model.path={workspace / 'model'}",
        f"data.train_files={workspace / 'data' / 'train.parquet'}",
        "data.max_prompt_length=64", "data.max_response_length=96",
        "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
        "algorithm.adv_estimator=grpo", "rollout.multi_turn.enable=true",
        "rollout.multi_turn.max_turns=2", "rollout.multi_turn.max_obs_length=40",
        f"retriever.source={url}", "retriever.topk=1",
        "model.enable_gradient_checkpointing=false", "trainer.device=cpu",
        "trainer.total_training_steps=1", "trainer.logger=[]",
        f"trainer.default_local_dir={run}", "reward.num_workers=0", *extra,
    ])  # fmt: skip


def test_a_server_that_fails_after_start_up_ends_the_run_at_its_first_batch(
    search_workspace, tmp_path, capsys
):
    with retrieval_server(search_workspace / "data" / "corpus.parquet", healthy_requests=1) as url:
        code = train(search_workspace, tmp_path / "run", url)
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert "the search tool failed on" in err and "calls of the first batch (100%)" in err
    assert f"first error: retrieval server {url} answered HTTP 500" in err
    assert "Traceback" not in err


def test_max_tool_error_fraction_above_one_never_stops(search_workspace, tmp_path, capsys):
    with retrieval_server(search_workspace / "data" / "corpus.parquet", healthy_requests=1) as url:
        code = train(
            search_workspace, tmp_path / "run", url, "trainer.logger=[console]",
            "rollout.multi_turn.max_tool_error_fraction=1.5",
        )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    step = next(line for line in out.splitlines() if line.startswith("step 1/1"))
    errors, calls = step.split("tool errors ")[1].split(",")[0].split("/")
    assert int(calls) >= int(errors) >= 5  # the calls that stop the run by default, and it went on


def test_a_server_down_at_start_up_is_one_line(search_workspace, tmp_path, capsys):
    with retrieval_server(search_workspace / "data" / "corpus.parquet", healthy_requests=0) as url:
        code = train(search_workspace, tmp_path / "run", url)
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert f"retrieval server {url} answered HTTP 500" in err and "start-up" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_step_line_shows_the_tool_errors(search_workspace, tmp_path, capsys):
    with retrieval_server(
        search_workspace / "data" / "corpus.parquet", healthy_requests=10**6
    ) as url:
        code = train(search_workspace, tmp_path / "run", url, "trainer.logger=[console]")
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    step = next(line for line in out.splitlines() if line.startswith("step 1/1"))
    assert "tool errors 0/" in step and ", timeouts 0" in step
