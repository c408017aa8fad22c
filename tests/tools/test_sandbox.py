"""The python tool's jail (`lmrl.tools.jail`): each escape of issue 31 is tried and fails.

Each escape runs as a policy's code would, through `PythonTool`, and the test then checks the
host: no file appeared, no process was signalled, no limit of ours changed. Each is tried in
both jails: the namespaces `lmrl.tools.jail` makes itself, and bubblewrap's
(`lmrl.tools.bwrap`); where the kernel refuses namespaces, or ``bwrap`` is not installed,
that jail's cases skip (the WEAK fallback is tested at the end).
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import subprocess
import sys
import threading
import time

import pytest

from lmrl.tools import jail
from lmrl.tools import python as python_module
from lmrl.tools.base import ToolError
from lmrl.tools.python import PythonTool, candidates, find_jail

PYTHON = sys.executable
JAILED, WHY = find_jail(PYTHON, "namespaces")
if shutil.which("bwrap"):
    BWRAP, BWRAP_WHY = find_jail(PYTHON, "bwrap")
else:
    BWRAP, BWRAP_WHY = "", "bwrap is not installed"
SKIP = {  # each jail's cases run where it works
    "namespaces": pytest.mark.skipif(not JAILED, reason=f"kernel namespaces refused: {WHY}"),
    "bwrap": pytest.mark.skipif(not BWRAP, reason=BWRAP_WHY),
}


@pytest.fixture(
    params=[
        pytest.param((jail_, hook), id=f"{jail_}-{hook}", marks=SKIP[jail_])
        for jail_ in SKIP
        for hook in ("audit hook too", "kernel alone")
    ]
)
def tool(request):
    """The tool in each jail as it runs, and without its audit hook: the kernel alone must
    hold too."""
    (jail_, hook) = request.param
    with pytest.MonkeyPatch.context() as patch:
        if hook == "kernel alone":
            runner = python_module.RUNNER.replace("sys.addaudithook(_hook)", "")
            assert runner != python_module.RUNNER
            patch.setattr(python_module, "RUNNER", runner)
        yield PythonTool(
            timeout_s=4, cpu_s=2, memory_mb=256, max_file_mb=1, disk_mb=2, isolation=jail_
        )


def _error(tool: PythonTool, code: str) -> str:
    with pytest.raises(ToolError) as err:
        tool.run(code)
    return str(err.value)


def test_the_code_runs_as_nobody_in_its_own_namespaces(tool):
    out = tool.run(
        "import os\n"
        "open('a.txt', 'w').write('ok')\n"
        "print(os.getuid(), os.getpid(), os.getcwd(), open('a.txt').read(), sorted(os.listdir('/proc'))[:3])"
    )
    uid, pid, cwd, text, *_ = out.split()
    assert uid == (str(jail.UID) if os.geteuid() == 0 else str(os.geteuid()))
    assert pid == "2" and cwd == jail.SANDBOX and text == "ok"  # PID 1 is the jail's init


def test_fork_exec_of_a_shell_neither_runs_nor_outlives_the_call(tool, tmp_path):
    target = tmp_path / "escaped.txt"
    code = (
        "import _posixsubprocess, os\n"
        "r, w = os.pipe()\n"
        f"_posixsubprocess.fork_exec([b'/bin/sh', b'-c', b'sleep 0.5; echo x > {target}'], "
        "[b'/bin/sh'], True, (w,), None, None, -1, -1, -1, -1, -1, -1, r, w, True, True, "
        "-1, None, None, None, -1, None, True)\n"
        "print('spawned')"
    )
    assert "Operation not permitted" in _error(tool, code)
    time.sleep(1.0)
    assert not target.exists()


@pytest.mark.parametrize(
    "code",
    [
        "import sqlite3; sqlite3.connect({path!r}).execute('create table t (x)')",
        "import os; os.mknod({path!r})",
        "import os; os.mkfifo({path!r})",
        "open({path!r}, 'w').write('x')",
        "import os; os.open({path!r}, os.O_CREAT | os.O_WRONLY)",
    ],
)
def test_nothing_is_created_outside_its_directory(tool, tmp_path, code):
    path = tmp_path / "made"
    _error(tool, code.format(path=str(path)))
    assert list(tmp_path.iterdir()) == []


def test_the_filesystem_outside_its_directory_is_read_only_and_the_trainers_unseen(tool, tmp_path):
    secret = tmp_path / "train.parquet"
    secret.write_text("ground truth")
    assert "No such file" in _error(tool, f"print(open({str(secret)!r}).read())")
    assert "FileNotFoundError" in _error(tool, "open('/etc/passwd').read()")
    # the interpreter's own files: readable, never writable (the mount, not the hook, says so)
    out = tool.run(
        "import os, sys; print(os.access(sys.prefix, os.W_OK), len(os.listdir(sys.prefix)) > 0)"
    )
    assert out.split() == ["False", "True"]


def test_xattrs_are_refused(tool):
    message = _error(tool, "import os\nopen('f', 'w').close()\nos.setxattr('f', 'user.x', b'1')")
    assert "not allowed" in message or "not permitted" in message


def test_prlimit_cannot_lower_the_trainers_limits(tool):
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    for pid in (os.getpid(), "os.getppid()"):
        _error(
            tool, f"import os, resource; resource.prlimit({pid}, resource.RLIMIT_NOFILE, (3, 3))"
        )
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == before


@pytest.mark.parametrize(
    "code",
    [
        "import os, signal; os.kill({pid}, signal.SIGKILL)",
        "import os, signal; signal.pidfd_send_signal(os.pidfd_open({pid}), signal.SIGKILL)",
    ],
)
def test_no_signal_reaches_another_process(tool, code):
    victim = subprocess.Popen(["sleep", "30"])
    try:
        _error(tool, code.format(pid=victim.pid))
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_proc_shows_no_process_of_the_host(tool):
    message = _error(tool, f"print(open('/proc/{os.getpid()}/cmdline').read())")
    assert "No such file" in message
    parent = tool.run(
        "import os; print(os.getppid(), open(f'/proc/{os.getppid()}/cmdline').read())"
    )
    assert parent.startswith("1 ") and "pytest" not in parent and "train_files" not in parent


def test_the_disk_quota_holds_and_is_reported(tool):
    code = "for i in range(100):\n    open(f'f{i}', 'wb').write(b'x' * 500_000)"
    message = _error(tool, code)  # the quota's error, not the time limit's
    assert "filled its 2 MiB of disk" in message and "No space left" in message


def _kill_when_it_runs(marker: str) -> None:
    """SIGKILL the sandboxed process whose argv holds ``marker``, as an OOM killer would."""
    for _ in range(200):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if marker.encode() in argv and b"-c" in argv:
                os.kill(int(pid), 9)
                return
        time.sleep(0.02)


@pytest.mark.parametrize("isolation", ["namespaces", pytest.param("bwrap", marks=SKIP["bwrap"])])
def test_each_death_is_reported_for_what_it_was(isolation):
    # an unexplained SIGKILL (memory_mb=123 marks this test's process among others)
    tool = PythonTool(timeout_s=5, cpu_s=3, memory_mb=123, max_file_mb=1, isolation=isolation)
    killer = threading.Thread(target=_kill_when_it_runs, args=(str(123 << 20),))
    killer.start()
    with pytest.raises(ToolError, match=r"killed by SIGKILL after .* not by one of its limits"):
        tool.run("import time; time.sleep(3)")
    killer.join()
    # its CPU limit (with room on the wall clock for a loaded machine), the wall clock, memory
    cpu = PythonTool(timeout_s=6, cpu_s=1, memory_mb=256, max_file_mb=1, isolation=isolation)
    with pytest.raises(ToolError, match=r"stopped at its limit \(1 s of CPU\)"):
        cpu.run("while True: pass")
    with pytest.raises(ToolError, match=r"ran out of its 256 MiB of memory: MemoryError"):
        cpu.run("x = bytearray(10 * 1024**3)")
    wall = PythonTool(timeout_s=1, cpu_s=5, memory_mb=256, max_file_mb=1, isolation=isolation)
    with pytest.raises(ToolError, match=r"1 s limit \(wall clock\)"):
        wall.run("import time; time.sleep(10)")


def _startup_lines(caplog, **options) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lmrl.tools"):
        PythonTool(disk_mb=16, **options)
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("python sandbox")]


def test_the_isolation_in_force_is_logged_once_when_built(caplog, monkeypatch):
    monkeypatch.delenv("LMRL_SANDBOX", raising=False)
    (line,) = _startup_lines(caplog)  # auto: bubblewrap where it works, else namespaces
    if BWRAP:
        assert line.startswith("python sandbox: bubblewrap 0.") and "16 MiB tmpfs" in line
        assert "(pid, mount, net, ipc, uts, cgroup namespaces)" in line
    elif JAILED:
        assert line.startswith("python sandbox: kernel namespaces (pid, mount, net, ipc, uts)")
        assert "16 MiB tmpfs" in line
    else:
        assert line.startswith("python sandbox: WEAK")
    if JAILED:
        (line,) = _startup_lines(caplog, isolation="namespaces")
        assert line.startswith("python sandbox: kernel namespaces (pid, mount, net, ipc, uts)")


def test_auto_prefers_bubblewrap_when_it_is_installed_and_works(monkeypatch, caplog):
    monkeypatch.delenv("LMRL_SANDBOX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: f"/usr/bin/{name}")
    assert candidates("auto") == ["bwrap", "namespaces"]
    assert candidates("namespaces") == ["namespaces"] and candidates("bwrap") == ["bwrap"]
    probe = lambda python, jail_, binds: "" if jail_ == "bwrap" else "no namespaces"  # noqa: E731
    monkeypatch.setattr(python_module, "_probe", probe)
    assert find_jail.__wrapped__(PYTHON, "auto") == ("bwrap", "")
    # bwrap installed but refused: namespaces, and the start-up line says what was passed over
    probe = lambda python, jail_, binds: "bwrap: broken" if jail_ == "bwrap" else ""  # noqa: E731
    monkeypatch.setattr(python_module, "_probe", probe)
    assert find_jail.__wrapped__(PYTHON, "auto") == ("namespaces", "bwrap: broken")
    monkeypatch.setattr(python_module, "find_jail", find_jail.__wrapped__)
    (line,) = _startup_lines(caplog)
    assert (
        line.startswith("python sandbox: kernel namespaces")
        and "[passed over: bwrap: broken]" in line
    )
    with pytest.raises(ValueError, match="LMRL_SANDBOX=bwrap, but bwrap: broken"):
        PythonTool(isolation="bwrap")
    monkeypatch.setenv("LMRL_SANDBOX", "bwrap")
    with pytest.raises(ValueError, match="LMRL_SANDBOX=bwrap, but bwrap: broken"):
        PythonTool()
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert candidates("auto") == ["namespaces"]
    monkeypatch.setenv("LMRL_SANDBOX", "docker")
    with pytest.raises(ValueError, match=r"LMRL_SANDBOX \(isolation\) must be one of auto, bwr"):
        PythonTool()


def test_without_namespaces_it_falls_back_and_says_so(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(python_module, "find_jail", lambda python, choice: ("", "unshare: EPERM"))
    with caplog.at_level(logging.INFO, logger="lmrl.tools"):
        weak = PythonTool(timeout_s=3, cpu_s=2, memory_mb=256, max_file_mb=1)
    assert "WEAK (kernel namespaces refused: unshare: EPERM)" in caplog.text
    assert weak.run("print(6 * 7)") == "42\n"
    # the audit hook and seccomp still hold there
    assert "sandbox: cannot write outside" in _error(weak, f"open({str(tmp_path / 'x')!r}, 'w')")
    assert list(tmp_path.iterdir()) == []
    assert "not allowed" in _error(weak, "import os; os.fork()")


def test_bubblewraps_command_line_holds_what_the_jail_needs(tmp_path, monkeypatch):
    from lmrl.tools import bwrap

    venv = tmp_path / "venv"
    venv.mkdir()
    argv = bwrap.command("/usr/bin/bwrap", "/src/jail.py", [str(venv)], disk_mb=3)
    text = " ".join(argv)
    assert argv[:4] == ["/usr/bin/bwrap", "--die-with-parent", "--new-session", "--as-pid-1"]
    assert "--size 3145728 --tmpfs /sandbox" in text and argv[-3:] == ["--chdir", "/sandbox", "--"]
    assert f"--perms 0755 --dir {tmp_path} " in text and f"--ro-bind {venv} {venv}" in text
    assert f"--ro-bind /src/jail.py {bwrap.INSIDE}" in text and "--seccomp" not in text
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # as root: no user namespace, three caps
    root = " ".join(bwrap.command("bwrap", "/src/jail.py", [], disk_mb=3))
    assert "--unshare-all" not in root and "--unshare-pid --unshare-net" in root
    caps = "--cap-drop ALL --cap-add CAP_SETUID --cap-add CAP_SETGID --cap-add CAP_CHOWN"
    assert caps in root
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "--unshare-all" in bwrap.command("bwrap", "/src/jail.py", [], disk_mb=3)
    # a bwrap without --size (before 0.8.0) would not hold the disk quota: refused
    old = tmp_path / "bwrap"
    old.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --version ]; then echo "bubblewrap 0.4.0"; else echo "--tmpfs --perms"; fi\n'
    )
    old.chmod(0o755)
    version, why = bwrap.version(str(old))
    assert version == "0.4.0" and "lacks --size, --as-pid-1 (0.8.0 or later" in why
