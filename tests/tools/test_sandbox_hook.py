"""The python sandbox's audit hook cannot be switched off from inside: what it refuses lives in a
closure the code cannot reach, and the obvious ways to reach it are refused or change nothing.

Run where the hook is the layer that refuses: without a jail (the WEAK fallback, where writes
outside the directory are the hook's alone) and in the namespaces jail (``ctypes`` is the
hook's alone there).
"""

from __future__ import annotations

import sys

import pytest

from lmrl.tools import python as python_module
from lmrl.tools.base import ToolError
from lmrl.tools.python import PythonTool, find_jail

JAILED, WHY = find_jail(sys.executable, "namespaces")

# ways into the hook's state, each followed by a call the hook refuses
REACH = {
    "main's globals": (
        "import sys\n"
        "main = sys.modules['__main__']\n"
        "main._DENY, main._PATHS, main._root = (), {}, '/'\n"
        "main._inside = lambda path: True\n"
        "main.isinstance = lambda *args: False\n"
    ),
    "os.path and builtins": (
        "import builtins, os, os.path\n"
        "os.path.realpath = lambda path: os.getcwd()\n"
        "os.fspath = lambda path: os.getcwd()\n"
        "builtins.isinstance = lambda *args: False\n"
        "builtins.PermissionError = ZeroDivisionError\n"
    ),
    "the hook's frame": (  # a refusal's traceback holds the hook's (finished) frame
        "try:\n"
        "    import gc\n"
        "    gc.get_objects()\n"
        "except PermissionError as err:\n"
        "    tb = err.__traceback__\n"
        "    while tb.tb_next:\n"
        "        tb = tb.tb_next\n"
        "    values = list(tb.tb_frame.f_locals.values())\n"
        "    assert values, 'the hook frame is reachable'\n"
        "    for value in values:\n"
        "        for cell in getattr(value, '__closure__', None) or ():\n"
        "            cell.cell_contents = ()\n"
        "        if isinstance(value, (dict, list, set)):\n"
        "            value.clear()\n"
    ),
}
REFUSED = {
    "ctypes": ("import ctypes\nctypes.CDLL(None)\n", "sandbox: ctypes.dlopen is not allowed"),
    "write outside": ("open({outside!r}, 'w').write('x')\n", "sandbox: cannot write outside"),
}
WALKS = {  # what could find the hook's function or rewrite its cells, refused outright
    "gc.get_objects": "import gc\ngc.get_objects()",
    "gc.get_referrers": "import gc, sys\ngc.get_referrers(sys.modules['__main__'])",
    "gc.get_referents": "import gc, sys\ngc.get_referents(sys.modules['__main__'])",
    "sys.settrace": "import sys\nsys.settrace(lambda *args: None)",
    "sys.setprofile": "import sys\nsys.setprofile(lambda *args: None)",
}


@pytest.fixture(
    scope="module",
    params=[
        "no jail",
        pytest.param(
            "namespaces", marks=pytest.mark.skipif(not JAILED, reason=f"namespaces: {WHY}")
        ),
    ],
)
def tool(request):
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "no jail":
            patch.setattr(python_module, "find_jail", lambda python, choice: ("", "test"))
        yield request.param, PythonTool(timeout_s=5, cpu_s=3, memory_mb=256, max_file_mb=1,
                                        isolation=None if request.param == "no jail" else
                                        request.param)  # fmt: skip


def _error(tool: PythonTool, code: str) -> str:
    with pytest.raises(ToolError) as err:
        tool.run(code)
    return str(err.value)


@pytest.mark.parametrize("refused", sorted(REFUSED))
@pytest.mark.parametrize("reach", sorted(REACH))
def test_the_hook_holds_after_the_code_tries_to_reach_its_deny_list(tool, tmp_path, reach,
                                                                    refused):  # fmt: skip
    jail, sandbox = tool
    if refused == "write outside" and jail != "no jail":
        pytest.skip("in a jail the read-only mounts refuse it before the hook")
    outside = tmp_path / "escaped"
    code, says = REFUSED[refused]
    assert says in _error(sandbox, REACH[reach] + code.format(outside=str(outside)))
    assert not outside.exists()


@pytest.mark.parametrize("event", sorted(WALKS))
def test_walks_over_objects_trace_functions_and_new_hooks_are_refused(tool, event):
    assert f"sandbox: {event} is not allowed" in _error(tool[1], WALKS[event])


def test_a_new_audit_hook_is_not_added(tool):
    """CPython drops the new hook silently when a hook refuses ``sys.addaudithook``."""
    code = "import sys\nsys.addaudithook(lambda *args: print('hooked'))\nprint('ran')"
    assert tool[1].run(code) == "ran\n"


def test_ordinary_code_still_runs(tool):
    code = (
        "import os, traceback\n"
        "os.mkdir('d')\n"
        "open('d/a', 'w').write('x')\n"
        "os.symlink('d/a', 'link')\n"
        "open('link', 'a').write('y')\n"
        "try:\n"
        "    1 / 0\n"
        "except ZeroDivisionError:\n"
        "    traceback.print_exc(limit=1)\n"
        "print(open('d/a').read())\n"
    )
    out = tool[1].run(code)
    assert "xy" in out and "ZeroDivisionError" in out
