"""The ``python`` tool: run the policy's code in a sandboxed process.

Each call is a fresh ``python -I`` process (no user site, no ``PYTHONPATH``) that

- starts in an empty temporary directory, removed afterwards, with an environment of its own
  (``PATH``, ``HOME`` and ``TMPDIR`` in that directory, ``LANG``, ``PYTHONHASHSEED=0``):
  nothing of the trainer's environment (tokens, keys) is inherited;
- has hard limits set by the kernel (``resource.setrlimit``): CPU seconds, address space,
  the size of any file it writes (its own stdout/stderr files included, so endless printing
  stops there), open files, and processes;
- leaves the network: it moves into new user and network namespaces where the kernel allows
  it (only a down loopback device is left), and refuses every socket either way;
- runs under an audit hook (``sys.addaudithook``, which code cannot remove) that refuses
  writing, deleting or renaming outside its directory, sockets, ``fork``/``exec``/
  ``subprocess``/``os.system``, signals to other processes, and ``ctypes``;
- is killed with its whole process group at a wall-clock timeout.

Its stdout, then its stderr, truncated to ``max_output_chars``, is the observation; a
failure (an exception, a limit, the timeout) is an ``Error: ...`` observation that the
policy reads. Nothing the code does ends or slows the run beyond the timeout.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from lmrl.tools.base import Tool, ToolError

__all__ = ["PythonTool"]

# The child's preamble: limits, namespaces, the audit hook; then the code from stdin. Written
# with no lmrl import so the child never loads torch or lmrl.
_RUNNER = r"""
import ctypes, os, resource, sys
_cpu, _mem, _fsize, _nofile = (int(x) for x in sys.argv[1:5])
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (_nofile, _nofile))
try:
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
except (ValueError, OSError):
    pass
try:  # CLONE_NEWUSER | CLONE_NEWNET: a network namespace with nothing in it
    ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000)
except Exception:
    pass
_code = sys.stdin.read()
_root = os.path.realpath(os.getcwd())
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_DENY = ("socket.", "subprocess.", "os.fork", "os.forkpty", "os.system", "os.exec",
         "os.posix_spawn", "os.spawn", "os.kill", "os.killpg", "ctypes.", "pty.",
         "os.setuid", "os.chroot", "resource.setrlimit", "sys.addaudithook")
_PATHS = {"os.remove": 1, "os.rename": 2, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1,
          "os.chown": 1, "os.link": 2, "os.symlink": 2, "os.truncate": 1, "os.utime": 1,
          "shutil.rmtree": 1, "os.replace": 2}

def _inside(path):
    if isinstance(path, int):
        return True
    real = os.path.realpath(os.fsdecode(path))
    return real == _root or real.startswith(_root + os.sep)

def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE)
        if path is not None and writing and not _inside(path):
            raise PermissionError(f"sandbox: cannot write outside its directory: {path}")
    elif event.startswith(_DENY):
        raise PermissionError(f"sandbox: {event} is not allowed")
    elif event in _PATHS:
        for path in args[: _PATHS[event]]:
            if path is not None and not _inside(path):
                raise PermissionError(f"sandbox: {event} outside its directory: {path}")

sys.addaudithook(_hook)
del ctypes, resource
exec(compile(_code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


class PythonTool(Tool):
    """Run Python code in a sandbox and return what it printed.

    Args:
        timeout_s: wall-clock limit per call.
        cpu_s: CPU-time limit (``RLIMIT_CPU``), seconds.
        memory_mb: address-space limit (``RLIMIT_AS``), MiB.
        max_file_mb: largest file it may write (``RLIMIT_FSIZE``), MiB.
        max_output_chars: stdout/stderr kept in the observation.
        python: the interpreter; default this one.
    """

    name = "python"
    description = "Run Python code; returns what it prints (stdout, then stderr)."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the Python code to run"}},
        "required": ["code"],
    }

    def __init__(
        self,
        timeout_s: float = 5.0,
        cpu_s: int = 5,
        memory_mb: int = 512,
        max_file_mb: int = 8,
        max_output_chars: int = 2000,
        python: str | None = None,
    ) -> None:
        for key, value in (
            ("timeout_s", timeout_s),
            ("cpu_s", cpu_s),
            ("memory_mb", memory_mb),
            ("max_file_mb", max_file_mb),
            ("max_output_chars", max_output_chars),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"python tool: {key} must be a positive number, got {value!r}")
        self.timeout_s, self.cpu_s = float(timeout_s), int(cpu_s)
        self.memory_mb, self.max_file_mb = int(memory_mb), int(max_file_mb)
        self.max_output_chars = int(max_output_chars)
        self.python = python or sys.executable

    def __call__(self, arguments: Mapping[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError("python needs non-empty code")
        return self.run(code)

    def call_batch(self, calls: Sequence[Mapping[str, Any]]) -> list[str | BaseException]:
        """Every call in its own process, all at once (each bounded by its own limits)."""
        out: list[str | BaseException] = []
        for arguments in calls:
            code = arguments.get("code")
            if not isinstance(code, str) or not code.strip():
                out.append(ToolError("python needs non-empty code"))
            else:
                out.append("")
        running = [
            (i, self._start(arguments["code"]))
            for i, arguments in enumerate(calls)
            if not isinstance(out[i], BaseException)
        ]
        for i, job in running:
            try:
                out[i] = self._finish(*job)
            except ToolError as err:
                out[i] = err
        return out

    def run(self, code: str) -> str:
        """Run ``code``; its output, or raise `ToolError` with what went wrong."""
        return self._finish(*self._start(code))

    # ------------------------------------------------------------------ internals
    def _start(self, code: str) -> tuple[subprocess.Popen, Path, float]:
        base = Path(tempfile.mkdtemp(prefix="lmrl-sandbox-"))
        work = base / "work"
        work.mkdir()
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(work),
            "TMPDIR": str(work),
            "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        limits = (self.cpu_s, self.memory_mb << 20, self.max_file_mb << 20, 64)
        with (base / "stdout").open("wb") as out, (base / "stderr").open("wb") as err:
            process = subprocess.Popen(
                [self.python, "-I", "-c", _RUNNER, *map(str, limits)],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                cwd=work,
                env=env,
                start_new_session=True,  # its own process group, killed as one
            )
        try:
            process.stdin.write(code.encode("utf-8", "replace"))
            process.stdin.close()
        except OSError:  # it died before reading its code; _finish reports how
            pass
        return process, base, time.monotonic()

    def _finish(self, process: subprocess.Popen, base: Path, started: float) -> str:
        try:
            left = max(0.0, self.timeout_s - (time.monotonic() - started))
            try:
                code = process.wait(timeout=left)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(process)
                code = process.wait()
            stdout = _read_head(base / "stdout", self.max_output_chars)
            stderr = _read_head(base / "stderr", self.max_output_chars)
        finally:
            _kill_group(process)  # anything it left behind in its group
            shutil.rmtree(base, ignore_errors=True)
        if timed_out:
            raise ToolError(f"the code ran past the {self.timeout_s:g} s limit and was stopped")
        if code == 0:
            text = stdout + (("\n" + stderr) if stderr.strip() else "")
            return self._clip(text) if text.strip() else "(no output)"
        why = _death(code, self.cpu_s, self.max_file_mb)
        tail = _last_line(stderr)
        detail = f": {tail}" if tail else ""
        raise ToolError(self._clip(f"{why}{detail}" + (f"\n{stdout}" if stdout.strip() else "")))

    def _clip(self, text: str) -> str:
        if len(text) <= self.max_output_chars:
            return text
        return text[: self.max_output_chars] + "\n... (output truncated)"


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):  # ProcessLookupError, PermissionError: already gone
        os.killpg(process.pid, signal.SIGKILL)


def _read_head(path: Path, limit: int) -> str:
    try:
        with path.open("rb") as f:
            return f.read(limit * 4 + 64).decode("utf-8", "replace")
    except OSError:
        return ""


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _death(code: int, cpu_s: int, max_file_mb: int) -> str:
    """Why the process ended with ``code`` (a negative code is the signal that killed it)."""
    if code >= 0:
        return f"the code failed (exit code {code})"
    sig = -code
    if sig in (signal.SIGXCPU, signal.SIGKILL):
        return f"the code was stopped at its limit ({cpu_s} s of CPU)"
    if sig == signal.SIGXFSZ:
        return f"the code wrote more than {max_file_mb} MiB"
    try:
        return f"the code was killed by {signal.Signals(sig).name}"
    except ValueError:
        return f"the code was killed by signal {sig}"
