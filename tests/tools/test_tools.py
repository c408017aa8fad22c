"""Tests of the tools: the interface, running a turn's calls, loading by name, search, python."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import ClassVar

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmrl.errors import ToolLoadError
from lmrl.tools import (
    PythonTool,
    SearchTool,
    Tool,
    ToolCall,
    ToolError,
    ToolFault,
    ToolResult,
    function_tool,
    load_tools,
    run_calls,
)
from lmrl.tools.loading import tool_schemas


def lookup(city: str, limit: int = 2) -> str:
    """Look a city up.

    Args:
        city: the city's name
        limit: how many facts
    """
    return f"{city}: {limit} facts"


# ---------------------------------------------------------------------------- interface
def test_function_tool_takes_its_schema_from_hints_and_docstring():
    tool = function_tool(lookup)
    assert tool.name == "lookup" and tool.description == "Look a city up."
    assert tool.parameters["required"] == ["city"]
    assert tool.parameters["properties"]["limit"]["type"] == "integer"
    assert tool.main_argument == "city"
    assert tool({"city": "Lumo"}) == "Lumo: 2 facts"
    assert tool.schema()["function"]["name"] == "lookup"
    with pytest.raises(ToolError, match="bad arguments for lookup"):
        tool({"town": "Lumo"})


def test_function_tool_without_docstring_args_is_a_clear_error():
    def bare(x):
        return x

    with pytest.raises(ValueError, match="type hints on every argument and a docstring"):
        function_tool(bare)


class Slow(Tool):
    """Sleeps ``s`` seconds or until ``release`` is set; ``woke`` is set when it returns."""

    name = "slow"
    parameters: ClassVar[dict] = {
        "type": "object",
        "properties": {"s": {"type": "number"}},
        "required": ["s"],
    }

    def __init__(self):
        self.release, self.woke = threading.Event(), threading.Event()

    def __call__(self, arguments):
        self.release.wait(arguments["s"])
        self.woke.set()
        return "woke"


class Boom(Tool):
    name = "boom"

    def __call__(self, arguments):
        raise RuntimeError("kaput")


def test_run_calls_keeps_order_and_turns_failures_into_observations():
    slow = Slow()
    tools = {"lookup": function_tool(lookup), "boom": Boom(), "slow": slow}
    calls = [
        ToolCall("lookup", {"city": "A"}),
        ToolCall("boom", {}),
        ToolCall("nope", {}),
        ToolResult("Error: unparsable", "invalid"),
        ToolCall("lookup", {"city": "B", "limit": 5}),
        ToolCall("slow", {"s": 30}),
    ]
    try:
        out = run_calls(calls, tools, timeout_s=0.5)
        assert not slow.woke.is_set()  # it answered while the slow call still slept
    finally:
        slow.release.set()
    assert [r.status for r in out] == ["ok", "error", "invalid", "invalid", "ok", "timeout"]
    assert out[0].text == "A: 2 facts" and out[4].text == "B: 5 facts"
    assert out[1].text == "Error: RuntimeError: kaput"
    assert "no tool named 'nope'" in out[2].text and "lookup" in out[2].text
    assert "timed out after 0.5 s" in out[5].text


def test_tools_of_one_kind_get_their_calls_in_one_batch():
    seen = []

    class Batched(Tool):
        name = "b"

        def call_batch(self, calls):
            seen.append(len(calls))
            return [str(c["x"] * 2) for c in calls]

    out = run_calls([ToolCall("b", {"x": i}) for i in range(5)], {"b": Batched()})
    assert seen == [5] and [r.text for r in out] == ["0", "2", "4", "6", "8"]


# ---------------------------------------------------------------------------- loading
def test_load_tools_builtins_and_a_users_file(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"contents": "Lumo\nLumo is a city."}) + "\n")
    user = tmp_path / "my_tools.py"
    user.write_text(
        "from lmrl.tools import Tool\n"
        "def weather(city: str) -> str:\n"
        '    """The weather.\n\n    Args:\n        city: where\n    """\n'
        "    return 'sunny in ' + city\n"
        "class Echo(Tool):\n"
        "    name = 'echo'\n"
        "    def __call__(self, arguments):\n"
        "        return str(arguments)\n"
    )
    tools = load_tools(
        ["search", "python", "weather", "Echo"], user, {"search": {"corpus": corpus, "topk": 1}}
    )
    assert list(tools) == ["search", "python", "weather", "Echo"]
    assert isinstance(tools["search"], SearchTool) and isinstance(tools["python"], PythonTool)
    assert tools["weather"]({"city": "Lumo"}) == "sunny in Lumo"
    assert tools["Echo"].name == "Echo"
    with pytest.raises(ToolLoadError, match="unknown tool 'nope'"):
        load_tools(["nope"], user)
    with pytest.raises(ToolLoadError, match="tool_path"):
        load_tools(["nope"])
    with pytest.raises(ToolLoadError, match=r"tool_path .*missing.py' does not exist"):
        load_tools(["x"], tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(ToolLoadError, match="importing the tool file"):
        load_tools(["x"], broken)
    with pytest.raises(ToolLoadError, match=r"the search tool: .*exactly one"):
        load_tools(["search"])
    with pytest.raises(ToolLoadError, match="twice"):
        load_tools(["python", "python"])
    # the schemas a chat template renders into the prompts: those of the tools themselves,
    # made without starting a built-in (no corpus needed)
    schemas = tool_schemas(["search", "python", "weather", "Echo"], user)
    assert schemas == [tool.schema() for tool in tools.values()]
    assert schemas[2]["function"]["parameters"]["required"] == ["city"]
    with pytest.raises(ToolLoadError, match="unknown tool 'nope'"):
        tool_schemas(["nope"], user)


# ---------------------------------------------------------------------------- processes
TOOL_FILE = """
import os, sys, time
from lmrl.tools import Tool, ToolError

def lookup(city: str) -> str:
    \"\"\"Look a city up.

    Args:
        city: the city's name
    \"\"\"
    if city == "hang":
        open({pid_file!r}, "w").write(str(os.getpid()))
        time.sleep(600)
    if city == "die":
        os._exit(3)
    if city == "bad":
        raise ToolError("no such city")
    if city == "broken":
        raise KeyError("the tool's own bug")
    return f"{{city}} from {{os.getpid()}}"

class Doubler(Tool):
    def call_batch(self, calls):
        return [f"{{c['x'] * 2}} from {{os.getpid()}}" for c in calls]
"""


def test_a_files_tools_run_in_processes_where_a_hung_call_is_killed(tmp_path):
    from lmrl.tools.processes import ProcessTool

    pid_file = tmp_path / "hung.pid"
    user = tmp_path / "my_tools.py"
    user.write_text(TOOL_FILE.format(pid_file=str(pid_file)))
    tools = load_tools(["lookup", "Doubler", "python"], user, processes=1, timeout_s=2.0)
    assert isinstance(tools["lookup"], ProcessTool) and isinstance(tools["Doubler"], ProcessTool)
    assert isinstance(tools["python"], PythonTool)  # the built-ins stay in this process
    assert tools["lookup"].parameters["required"] == ["city"]
    try:
        calls = [ToolCall("lookup", {"city": c}) for c in ("A", "hang", "die", "bad")]
        calls += [ToolCall("Doubler", {"x": 1}), ToolCall("Doubler", {"x": 2})]
        calls += [ToolCall("lookup", {"city": "B"}), ToolCall("lookup", {"city": "broken"})]
        out = run_calls(calls, tools, timeout_s=2.0)  # "hang" sleeps 600 s
        statuses = ["ok", "timeout", "error", "error", "ok", "ok", "ok", "error"]
        assert [r.status for r in out] == statuses
        # the tool's failures (a timeout, a dead worker, its own bug) count against it, as
        # in-process; the call's own ToolError does not
        assert [r.fault for r in out] == [False, True, True, False, False, False, False, True]
        assert out[7].text == 'Error: KeyError: "the tool\'s own bug"'
        pids = {int(r.text.split(" from ")[1]) for r in out if r.status == "ok"}
        assert os.getpid() not in pids
        assert out[1].text == "Error: the lookup tool timed out after 2 s"
        assert out[2].text == "Error: lookup: the tool worker process exited with code 3"
        assert out[3].text == "Error: no such city"
        assert out[4].text.startswith("2 from ") and out[5].text.startswith("4 from ")
        assert out[4].text.split()[-1] == out[5].text.split()[-1]  # one batch, one process
        with pytest.raises(ProcessLookupError):  # the hung call's process was killed
            os.kill(int(pid_file.read_text()), 0)
        again = run_calls([ToolCall("lookup", {"city": "C"})], tools)
        assert again[0].status == "ok" and again[0].text.startswith("C from ")
        assert tools["lookup"]({"city": "D"}).startswith("D from ")
        with pytest.raises(ToolError, match="no such city") as raised:
            tools["lookup"]({"city": "bad"})
        assert type(raised.value) is ToolError
        with pytest.raises(ToolFault, match="the tool's own bug"):
            tools["lookup"]({"city": "broken"})
    finally:
        for tool in tools.values():
            tool.close()
    assert tools["lookup"].pool._workers == []


def test_a_tool_file_that_a_worker_cannot_import_is_a_load_error(tmp_path):
    user = tmp_path / "my_tools.py"
    user.write_text(
        "import sys\n"
        "if 'lmrl._procworker' in sys.modules or sys.argv[0].endswith('_procworker.py'):\n"
        "    raise ImportError('only in the trainer')\n"
        "def lookup(city: str) -> str:\n"
        '    """Look.\n\n    Args:\n        city: where\n    """\n'
        "    return city\n"
    )
    tools = load_tools(["lookup"], user, processes=1, timeout_s=5.0)
    try:
        with pytest.raises(ToolLoadError, match=r"tool worker process could not load.*only in"):
            run_calls([ToolCall("lookup", {"city": "A"})], tools)
    finally:
        tools["lookup"].close()


# ---------------------------------------------------------------------------- search
def test_search_reads_parquet_and_jsonl_and_ranks_the_matching_passage(tmp_path):
    rows = [
        {"title": "Vokar", "text": "Vokar lives in Lumo."},
        {"title": "Quel", "text": "Quel lives in Tavi and works for Vokar."},
        {"title": "Zib", "text": "Zib lives in Pom."},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    (tmp_path / "c.jsonl").write_text(
        "\n".join(json.dumps({"contents": f"{r['title']}\n{r['text']}"}) for r in rows)
    )
    for name in ("c.parquet", "c.jsonl"):
        tool = SearchTool(tmp_path / name, topk=2)
        text = tool({"query": "Vokar"})
        assert text.splitlines()[0] == "Doc 1(Title: Vokar) Vokar lives in Lumo."
        assert text.splitlines()[1].startswith("Doc 2(Title: Quel)")
        assert tool({"query": "nothing matches this"}) == "No results found."
    out = tool.call_batch([{"query": "Zib"}, {"query": ""}, {"query": "Quel Tavi"}])
    assert out[0].startswith("Doc 1(Title: Zib)") and isinstance(out[1], ToolError)
    assert out[2].startswith("Doc 1(Title: Quel)")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "holds no passages"),
        ('{"body": "x"}\n', "neither 'contents' nor 'text'"),
        ("not json\n", "cannot be read"),
    ],
)
def test_bad_corpus_files_are_named_errors(tmp_path, content, message):
    path = tmp_path / "c.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        SearchTool(path)
    csv = tmp_path / "c.csv"
    csv.write_text("a")
    with pytest.raises(ValueError, match="unknown format"):
        SearchTool(csv)
    with pytest.raises(ValueError, match="no such file"):
        SearchTool(tmp_path / "missing.parquet")


def test_search_recall_on_the_search_qa_task(tmp_path):
    """The BM25 tool finds the passage holding each hop's fact (recall@1 and @3 reported)."""
    from lmrl.data.tasks import write_task

    paths = write_task("search_qa", tmp_path, num_train=0, num_test=256)
    tool = SearchTool(paths["corpus"], topk=3)
    rows = pq.read_table(paths["test"]).to_pylist()
    hits = {1: 0, 3: 0}
    total = 0
    for row in rows:
        for query, fact in zip(
            row["extra_info"]["queries"], row["extra_info"]["facts"], strict=True
        ):
            found = tool.retrieve([query])[0]
            total += 1
            for k in hits:
                hits[k] += any(p["title"] == query and fact in p["text"] for p in found[:k])
    recall = {k: v / total for k, v in hits.items()}
    print(f"search_qa BM25 recall over {total} hops: @1 {recall[1]:.3f}, @3 {recall[3]:.3f}")
    assert recall[1] >= 0.95 and recall[3] >= 0.99


class _Retrieval(BaseHTTPRequestHandler):
    """Search-R1's retrieval server shape: one hit list per query."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        result = [
            [{"document": {"contents": f"T{q}\npassage about {q}"}, "score": 1.0}]
            for q in body["queries"]
        ]
        data = json.dumps({"result": result}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_search_against_a_retrieval_server_sends_a_turn_in_one_request():
    server = HTTPServer(("127.0.0.1", 0), _Retrieval)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/retrieve"
        tool = SearchTool(url=url, topk=3)
        out = tool.call_batch([{"query": "alpha"}, {"query": "beta"}])
        assert out == [
            "Doc 1(Title: Talpha) passage about alpha",
            "Doc 1(Title: Tbeta) passage about beta",
        ]
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(ToolError, match=r"retrieval server .* cannot be reached"):
        SearchTool(url=url, topk=1, timeout_s=2, probe_timeout_s=None)({"query": "x"})


# ---------------------------------------------------------------------------- python
@pytest.fixture(scope="module")
def python_tool():
    return PythonTool(timeout_s=3, cpu_s=2, memory_mb=256, max_file_mb=1, max_output_chars=200)


def test_python_runs_code_and_returns_its_output(python_tool):
    assert python_tool({"code": "print(sum(range(10)))"}) == "45\n"
    assert python_tool({"code": "x = 1"}) == "(no output)"
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        python_tool({"code": "1/0"})
    long = python_tool({"code": "print('x' * 5000)"})
    assert len(long) < 260 and long.endswith("(output truncated)")


ABUSES = {
    "infinite loop": ("while True: pass", "limit"),
    "sleep past the timeout": ("import time; time.sleep(60)", "3 s limit"),
    "fork bomb": ("import os\nwhile True: os.fork()", "os.fork is not allowed"),
    "subprocess": ("import subprocess; subprocess.run(['true'])", "not allowed"),
    "10 GB allocation": ("x = bytearray(10 * 1024**3)", "MemoryError"),
    "socket": ("import socket; socket.socket().connect(('127.0.0.1', 9))", "not allowed"),
    "endless printing": ("while True: print('y' * 1000)", "File too large"),
    "ctypes": ("import ctypes; ctypes.CDLL(None)", "ctypes.dlopen is not allowed"),
}


@pytest.mark.parametrize("name", list(ABUSES))
def test_python_sandbox_turns_each_abuse_into_an_error(python_tool, name):
    code, message = ABUSES[name]
    out = run_calls([ToolCall("python", {"code": code})], {"python": python_tool}, timeout_s=20)[0]
    # the sandbox stopped it ("error"), not run_calls' 20 s ("timeout")
    assert out.status == "error" and out.text.startswith("Error: ") and message in out.text


def test_python_sandbox_leaves_the_host_filesystem_alone(python_tool, tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("original")
    before = sorted(p.name for p in tmp_path.iterdir())
    codes = [
        f"open({str(keep)!r}, 'w').write('changed')",
        f"import os; os.remove({str(keep)!r})",
        f"import os; os.rename({str(keep)!r}, 'stolen.txt')",
        f"open({str(tmp_path / 'new.txt')!r}, 'w').write('x')",
        "open('../escape.txt', 'w').write('x')",
        f"import shutil; shutil.rmtree({str(tmp_path)!r})",
    ]
    for code in codes:
        out = run_calls([ToolCall("python", {"code": code})], {"python": python_tool})[0]
        assert out.status == "error" and "sandbox" in out.text, code
    assert keep.read_text() == "original"
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    # its own directory is writable, and nothing of the trainer's environment reaches it
    out = python_tool(
        {
            "code": "import os\nopen('a.txt','w').write('ok')\nprint(open('a.txt').read(), sorted(os.environ))"
        }
    )
    assert out.startswith("ok ") and "HOME" in out and "LMRL" not in out and "PYTHONPATH" not in out
