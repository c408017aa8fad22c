"""The ``python`` tool: run the policy's code in a sandbox that the kernel holds shut.

Each call is a fresh ``python -I`` process (no user site, no ``PYTHONPATH``) started by the
launcher of `lmrl.tools.jail` (a process of its own: no ctypes, no namespaces in the trainer),
inside bubblewrap's jail (`lmrl.tools.bwrap`) when ``bwrap`` is installed and works, else in
namespaces the launcher makes itself (``LMRL_SANDBOX``: ``auto``, ``bwrap`` or ``namespaces``):

- in new PID, mount, network, IPC and UTS namespaces, as uid/gid 65534 without capabilities
  (its own uid in a user namespace when the trainer is not root), with no-new-privs;
- on a root of its own: the interpreter's files read-only, a ``/proc`` of its namespace, and
  ``/sandbox``, a tmpfs of ``disk_mb`` MiB, its working directory and only writable place;
  nothing of the trainer (files, ``/proc``, environment: tokens, keys) is reachable;
- under kernel limits (CPU seconds, address space, the size of one file, its own stdout
  and stderr included, open files) and a seccomp filter (no processes, exec, signals,
  sockets, device nodes, xattrs, mounts, namespaces, tracing, raised limits);
- under an audit hook as a second layer (writes outside its directory, sockets,
  ``subprocess``, signals, ``ctypes``) that the code cannot switch off: its state is closed
  over, no global, and gc's object walks, trace functions and new hooks are refused;
- killed with its process group at a wall-clock timeout; when the code ends the kernel kills
  whatever is left in its PID namespace.

Where the kernel refuses namespaces (`find_jail`, tried once) the tool falls back to the
rlimits, seccomp, the audit hook and a network namespace, and says so: one line when the tool
is built names the isolation in force (``python sandbox: bubblewrap 0.8.0 (...)``,
``python sandbox: kernel namespaces (...)`` or ``python sandbox: WEAK (...)``).

Its stdout, then its stderr, truncated to ``max_output_chars``, is the observation; a
failure is an ``Error: ...`` observation naming it (an exception, its CPU limit, the wall
clock, memory, the disk, the file size, or a kill that none of these explains). Nothing the
code does ends or slows the run beyond the timeout.
"""

from __future__ import annotations

import contextlib
import functools
import logging
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

from lmrl.tools import bwrap, jail
from lmrl.tools.base import Tool, ToolError
from lmrl.tools.jail import RUNNER, SANDBOX, encode, parse_status

__all__ = ["PythonTool"]

_JAIL = str(Path(__file__).with_name("jail.py"))
_NOFILE = 64
log = logging.getLogger("lmrl.tools")
interpreter_paths = functools.cache(jail.interpreter_paths)  # one subprocess per interpreter


ISOLATIONS = ("auto", "bwrap", "namespaces")


def candidates(choice: str) -> list[str]:
    """The jails to try for ``LMRL_SANDBOX=choice``, best first: ``auto`` prefers bubblewrap
    when ``bwrap`` is on ``PATH``."""
    if choice not in ISOLATIONS:
        raise ValueError(
            f"python tool: LMRL_SANDBOX (isolation) must be one of {', '.join(ISOLATIONS)}, "
            f"got {choice!r}"
        )
    if choice == "auto":
        return (["bwrap"] if bwrap.which() else []) + ["namespaces"]
    return [choice]


@functools.cache
def find_jail(python: str, choice: str = "auto") -> tuple[str, str]:
    """The jail this machine can hold ``python``'s code in: ``("bwrap", notes)`` or
    ``("namespaces", notes)``, ``notes`` saying why a better one was passed over; or
    ``("", why)`` when none works (the WEAK fallback).

    Each of `candidates` is tried once per interpreter by running ``print(1)`` in it.
    """
    try:
        binds = interpreter_paths(python)
    except (OSError, subprocess.SubprocessError, ValueError) as err:
        return "", f"cannot inspect {python}: {err}"
    refused = []
    for backend in candidates(choice):
        why = _probe(python, backend, binds)
        if not why:
            return backend, "; ".join(refused)
        refused.append(why)
    return "", "; ".join(refused)


def _probe(python: str, backend: str, binds: list[str]) -> str:
    """Why ``backend`` cannot jail ``python``; empty when ``print(1)`` runs in it."""
    if backend == "bwrap":
        path = bwrap.which()
        if path is None:
            return "bwrap is not on PATH"
        why = bwrap.version(path)[1]
        if why:
            return why
    try:
        out = PythonTool(python=python, _jail=(backend, binds)).run("print(1)")
    except ToolError as err:
        return f"bwrap: {err}" if backend == "bwrap" else str(err)
    if out.strip() != "1":
        return f"the {backend} jail's probe printed {out[:80]!r}"
    return ""


class PythonTool(Tool):
    """Run Python code in a sandbox and return what it printed.

    Args:
        timeout_s: wall-clock limit per call.
        cpu_s: CPU-time limit (``RLIMIT_CPU``), seconds.
        memory_mb: address-space limit (``RLIMIT_AS``), MiB.
        max_file_mb: largest file it may write (``RLIMIT_FSIZE``), MiB.
        disk_mb: size of its working directory's tmpfs, MiB (the total it may write).
        max_output_chars: stdout/stderr kept in the observation.
        python: the interpreter; default this one.
        isolation: ``auto`` (bubblewrap when ``bwrap`` is installed and works, else kernel
            namespaces, else WEAK), ``bwrap`` (an error without it) or ``namespaces``;
            default the environment's ``LMRL_SANDBOX``, else ``auto``.
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
        disk_mb: int = 64,
        max_output_chars: int = 2000,
        python: str | None = None,
        isolation: str | None = None,
        _jail: tuple[str, list[str]] | None = None,
    ) -> None:
        for key, value in (
            ("timeout_s", timeout_s),
            ("cpu_s", cpu_s),
            ("memory_mb", memory_mb),
            ("max_file_mb", max_file_mb),
            ("disk_mb", disk_mb),
            ("max_output_chars", max_output_chars),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"python tool: {key} must be a positive number, got {value!r}")
        self.timeout_s, self.cpu_s = float(timeout_s), int(cpu_s)
        self.memory_mb, self.max_file_mb = int(memory_mb), int(max_file_mb)
        self.disk_mb, self.max_output_chars = int(disk_mb), int(max_output_chars)
        self.python = python or sys.executable
        if _jail is not None:  # the probe of `find_jail`
            self.backend, self._binds = _jail
        else:
            choice = isolation or os.environ.get("LMRL_SANDBOX") or "auto"
            self.backend, why = find_jail(self.python, choice)
            if choice == "bwrap" and self.backend != "bwrap":
                raise ValueError(f"python tool: LMRL_SANDBOX=bwrap, but {why}")
            self._binds = interpreter_paths(self.python) if self.backend else []
        self.jailed = bool(self.backend)
        self._bwrap = []  # bubblewrap's argv, the launcher's command line to follow
        if self.backend == "bwrap":
            self._bwrap = bwrap.command(bwrap.which() or "bwrap", _JAIL, self._binds, disk_mb)
        if _jail is None:
            (log.info if self.jailed else log.warning)("python sandbox: %s", self.describe(why))

    def describe(self, why: str = "") -> str:
        """One line: which isolation is active (logged when the tool is built)."""
        limits = (
            f"{self.cpu_s} s CPU, {self.memory_mb} MiB memory, {self.max_file_mb} MiB a file, "
            f"{self.timeout_s:g} s wall clock"
        )
        seccomp = "seccomp" if os.uname().machine == "x86_64" else "no seccomp (not x86_64)"
        if self.jailed:
            who = "uid 65534" if os.geteuid() == 0 else f"uid {os.geteuid()} (user namespace)"
            jail = "kernel namespaces (pid, mount, net, ipc, uts)"
            if self.backend == "bwrap":
                version = bwrap.version(self._bwrap[0])[0]
                jail = f"bubblewrap {version} (pid, mount, net, ipc, uts, cgroup namespaces)"
            passed = f" [passed over: {why}]" if why else ""
            return (
                f"{jail}, {who}, {seccomp}, read-only stdlib, {self.disk_mb} MiB tmpfs; "
                f"{limits}{passed}"
            )
        return (
            f"WEAK (kernel namespaces refused: {why}): rlimits, {seccomp}, an audit hook, "
            f"the host's filesystem as this user, a {self.disk_mb} MiB disk quota not "
            f"enforced; {limits}"
        )

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
        (base / "root").mkdir()
        home = SANDBOX if self.jailed else str(work)
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": home,
            "TMPDIR": home,
            "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
        }
        limits = (self.cpu_s, self.memory_mb << 20, self.max_file_mb << 20, _NOFILE)
        argv = [self.python, "-I", "-c", RUNNER, *map(str, limits), int(not self.jailed), 1]
        with (
            (base / "stdout").open("wb") as out,
            (base / "stderr").open("wb") as err,
            (base / "status").open("wb") as status,
        ):
            settings = {
                "jail": self.jailed,
                "bwrap": self.backend == "bwrap",
                "argv": [str(a) for a in argv],
                "env": env,
                "cwd": str(work),
                "root": str(base / "root"),
                "binds": self._binds,
                "disk_mb": self.disk_mb,
                "status_fd": status.fileno(),
            }
            launcher = bwrap.INSIDE if self._bwrap else _JAIL
            process = subprocess.Popen(
                [*self._bwrap, self.python, "-I", "-S", launcher, encode(settings)],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                cwd=work,
                env=env,
                pass_fds=(status.fileno(),),
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
                process.wait(timeout=left)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(process)
                process.wait()
            stdout = _read_head(base / "stdout", self.max_output_chars)
            stderr = _read_head(base / "stderr", self.max_output_chars)
            status = _read_status(base / "status")
        finally:
            _kill_group(process)  # anything it left behind in its group
            shutil.rmtree(base, ignore_errors=True)
        if timed_out:
            raise ToolError(
                f"the code ran past the {self.timeout_s:g} s limit (wall clock) and was stopped"
            )
        if "error" in status or not status:
            why = status.get("error") or _last_line(stderr) or f"exit code {process.returncode}"
            raise ToolError(f"the sandbox could not start: {why}")
        if status.get("code") == 0:
            text = stdout + (("\n" + stderr) if stderr.strip() else "")
            return self._clip(text) if text.strip() else "(no output)"
        tail = _last_line(stderr)
        why = self._death(status, tail)
        detail = f": {tail}" if tail else ""
        raise ToolError(self._clip(f"{why}{detail}" + (f"\n{stdout}" if stdout.strip() else "")))

    def _death(self, status: dict, tail: str) -> str:
        """Why the code ended with ``status`` (``{"code": N}`` or ``{"signal": S, "cpu_s": X}``)."""
        cpu = float(status.get("cpu_s", 0.0))
        if "signal" not in status:
            if "No space left on device" in tail or "Errno 28" in tail:
                return f"the code filled its {self.disk_mb} MiB of disk"
            if tail.startswith("MemoryError"):
                return f"the code ran out of its {self.memory_mb} MiB of memory"
            return f"the code failed (exit code {status['code']})"
        sig = int(status["signal"])
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= self.cpu_s - 0.05):
            return f"the code was stopped at its limit ({self.cpu_s} s of CPU)"
        if sig == signal.SIGXFSZ:
            return f"the code wrote more than {self.max_file_mb} MiB to one file"
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        if sig == signal.SIGKILL:
            return (
                f"the code was killed by SIGKILL after {cpu:g} s of CPU, not by one of its "
                "limits (the machine's out-of-memory killer?)"
            )
        return f"the code was killed by {name}"

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


def _read_status(path: Path) -> dict:
    """The launcher's report (`lmrl.tools.jail`); empty if it wrote none (it was killed)."""
    try:
        return parse_status(path.read_text(errors="replace"))
    except OSError:
        return {}


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""
