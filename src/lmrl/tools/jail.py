"""The python tool's jail: a launcher that the kernel, not Python, holds shut.

`lmrl.tools.python` runs ``python -I -S jail.py SETTINGS`` for each call; this file imports
only the standard library (no lmrl, no torch) and never runs in the trainer's process.

With ``"jail": true`` the launcher (as root; otherwise it first enters a new user namespace
mapping only its own, non-root uid) moves into new mount, PID, network, IPC and UTS
namespaces and forks the new PID namespace's init, which

- builds a new root on a small tmpfs: read-only bind mounts of ``/usr``, ``/lib*`` and the
  interpreter's prefixes, ``/dev/null``, ``/dev/zero``, ``/dev/urandom``, a fresh ``/proc``
  that shows only this namespace, and ``/sandbox``, a tmpfs of ``disk_mb`` MiB (the disk
  quota), the only writable place; it ``pivot_root``'s into it and detaches the old root
  (the mounts are made as root, before the drop: an interpreter under ``/root`` is out of
  uid 65534's reach);
- drops to uid/gid 65534 with no groups and no capabilities (as root), sets no-new-privs;
- forks the code's process, which ``execve``'s the runner (`RUNNER`): rlimits, a seccomp
  filter, then an audit hook as a second layer (its state closed over, out of the code's
  reach: see ``_make_hook`` in `RUNNER`), then the code;
- waits for it and writes ``code N CPU_S`` or ``signal S CPU_S`` to ``status_fd``;
  when init exits, the kernel kills whatever else is left in the namespace.

With ``"bwrap": true`` bubblewrap (`lmrl.tools.bwrap`) has built all of the above but the drop
and started this launcher as its PID namespace's init: as root it gives ``/sandbox`` to 65534
and drops to it (bwrap left it only ``CAP_SETUID``, ``CAP_SETGID``, ``CAP_CHOWN``), then forks
the code's process and reports as above.

With ``"jail": false`` (the kernel refuses namespaces) it only forks, runs the runner in the
host's working directory and reports the same status. A failure to build the jail is
written as ``error WHY``.
"""

from __future__ import annotations

import marshal
import os
import resource
import stat
import sys

# The code's process: limits, seccomp, the audit hook; then the code from stdin. Run with
# ``python -I -c RUNNER CPU_S MEM_BYTES FSIZE_BYTES NOFILE UNSHARE_NET SECCOMP``.
RUNNER = r"""
import ctypes, os, resource, struct, sys
_cpu, _mem, _fsize, _nofile, _net, _seccomp = (int(x) for x in sys.argv[1:7])
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
resource.setrlimit(resource.RLIMIT_NOFILE, (_nofile, _nofile))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
_libc = ctypes.CDLL(None, use_errno=True)
if _net:  # CLONE_NEWUSER | CLONE_NEWNET: a network namespace with nothing in it
    _libc.unshare(0x10000000 | 0x40000000)
_seccomp = _seccomp and os.uname().machine == "x86_64"
if not _seccomp:  # fork is refused by seccomp when there is one; else by this (non-root)
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    except (ValueError, OSError):
        pass
else:
    # x86_64 syscall numbers refused with EPERM: process creation and exec, signals, sessions,
    # device nodes, xattrs, mounts and namespaces, tracing, keys, bpf, io_uring, setrlimit,
    # open_by_handle_at.
    _DENY = (57, 58, 59, 322, 62, 200, 234, 129, 297, 424, 434, 438, 109, 112, 41, 53,
             133, 259, 188, 189, 190, 197, 198, 199, 463, 466, 165, 166, 155, 161, 272, 308,
             428, 429, 430, 431, 432, 433, 442, 101, 310, 311, 312, 248, 249, 250, 321, 298,
             323, 425, 426, 427, 160, 135, 304)
    _ALLOW, _EPERM, _ENOSYS = 0x7FFF0000, 0x00050001, 0x00050026
    def _op(code, k, jt=0, jf=0):
        return struct.pack("HBBI", code, jt, jf, k)
    _LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
    _prog = [_op(_LD, 4), _op(_JEQ, 0xC000003E, 1, 0), _op(_RET, _ENOSYS),  # x86_64 only
             _op(_LD, 0), _op(_JGE, 0x40000000, 0, 1), _op(_RET, _ENOSYS)]  # no x32
    for _nr in _DENY:
        _prog += [_op(_JEQ, _nr, 0, 1), _op(_RET, _EPERM)]
    _prog += [_op(_JEQ, 435, 0, 1), _op(_RET, _ENOSYS),  # clone3: glibc falls back to clone
              _op(_JEQ, 56, 0, 4), _op(_LD, 16), _op(_JSET, 0x10000, 1, 0),  # clone: threads
              _op(_RET, _EPERM), _op(_RET, _ALLOW),
              _op(_JEQ, 302, 0, 6), _op(_LD, 32), _op(_JEQ, 0, 0, 3), _op(_LD, 36),
              _op(_JEQ, 0, 0, 1), _op(_RET, _ALLOW), _op(_RET, _EPERM),  # prlimit64: read only
              _op(_RET, _ALLOW)]
    _buf = ctypes.create_string_buffer(b"".join(_prog))
    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    _fprog = _Prog(len(_prog), ctypes.addressof(_buf))
    if _libc.prctl(38, 1, 0, 0, 0) or _libc.prctl(22, 2, ctypes.byref(_fprog), 0, 0):
        raise SystemExit(f"sandbox: seccomp refused: {os.strerror(ctypes.get_errno())}")
_code = sys.stdin.read()

def _make_hook():
    # Everything the hook reads is bound here, before the code runs, and closed over: an
    # immutable value or a builtin function, never a module global (the code can rebind
    # those: sys.modules["__main__"], os.path, builtins), a mutable container or a Python
    # function (its cells could be rewritten). The hook itself is held only by the
    # interpreter's list of audit hooks; gc's walks over objects, trace and profile
    # functions (which can rewrite a running frame's locals), ctypes and new audit hooks
    # are refused, so nothing the code can reach changes what it refuses.
    import stat
    lstat, readlink, getcwd, fspath = os.lstat, os.readlink, os.getcwd, os.fspath
    is_link, str_, bytes_, int_, isinstance_ = stat.S_ISLNK, str, bytes, int, isinstance
    OSError_, Denied = OSError, PermissionError
    root = os.path.realpath(getcwd())
    inside = root.rstrip("/") + "/"
    writes = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    deny = ("socket.", "subprocess.", "os.fork", "os.forkpty", "os.system", "os.exec",
            "os.posix_spawn", "os.spawn", "os.kill", "os.killpg", "ctypes.", "pty.",
            "os.setuid", "os.chroot", "resource.setrlimit", "resource.prlimit",
            "sys.addaudithook", "os.setxattr", "os.removexattr", "signal.pthread_kill",
            "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.settrace",
            "sys.setprofile", "sys._settraceallthreads", "sys._setprofileallthreads",
            "sys.monitoring.")
    path_events = (("os.remove", 1), ("os.rename", 2), ("os.rmdir", 1), ("os.mkdir", 1),
                   ("os.chmod", 1), ("os.chown", 1), ("os.link", 2), ("os.symlink", 2),
                   ("os.truncate", 1), ("os.utime", 1), ("shutil.rmtree", 1),
                   ("os.replace", 2), ("os.mknod", 1), ("os.mkfifo", 1),
                   ("sqlite3.connect", 1))
    path_names = frozenset(name for name, _ in path_events)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (isinstance_(mode, str_) and (
                "w" in mode or "a" in mode or "x" in mode or "+" in mode)) or (
                isinstance_(flags, int_) and flags & writes)
            if not writing:
                return
            paths = (path,)
        elif event.startswith(deny):
            raise Denied(f"sandbox: {event} is not allowed")
        elif event in path_names:
            for name, count in path_events:
                if name == event:
                    paths = args[:count]
        else:
            return
        for path in paths:
            if path is None or isinstance_(path, int_):
                continue
            path = fspath(path)
            if isinstance_(path, bytes_):
                path = path.decode("utf-8", "surrogateescape")
            if path == ":memory:":
                continue
            # os.path.realpath's walk, inline: each component, symbolic links followed
            todo = (path if path.startswith("/") else getcwd() + "/" + path).split("/")
            todo.reverse()
            real, links = "", 0
            while todo:
                part = todo.pop()
                if part == "" or part == ".":
                    continue
                if part == "..":
                    real = real[: real.rfind("/")] if real else ""
                    continue
                step = real + "/" + part
                try:
                    link = is_link(lstat(step).st_mode)
                except OSError_:
                    link = False
                if not link:
                    real = step
                    continue
                links += 1
                if links > 40:
                    raise Denied(f"sandbox: too many symbolic links: {path}")
                target = readlink(step).split("/")
                target.reverse()
                todo += target
                if not target[-1]:  # an absolute target starts again at /
                    real = ""
            if real != root and not (real + "/").startswith(inside):
                where = "cannot write outside its directory" if event == "open" else (
                    f"{event} outside its directory")
                raise Denied(f"sandbox: {where}: {path}")

    return hook

_hook = _make_hook()
sys.addaudithook(_hook)
del _hook, _make_hook
del ctypes, resource, _libc
exec(compile(_code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""

SANDBOX = "/sandbox"  # the code's working directory inside the jail
UID = 65534  # nobody: who the code runs as when the trainer is root

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWUSER, _CLONE_NEWPID, _CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_MNT_DETACH, _PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 2, 1, 38
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
# the statvfs flags a bind remount inside a user namespace must keep (they are locked)
_KEEP = ((os.ST_RDONLY, _MS_RDONLY), (os.ST_NOSUID, _MS_NOSUID), (os.ST_NODEV, _MS_NODEV),
         (os.ST_NOEXEC, _MS_NOEXEC), (os.ST_NOATIME, _MS_NOATIME),
         (os.ST_NODIRATIME, _MS_NODIRATIME), (os.ST_RELATIME, _MS_RELATIME))  # fmt: skip
SYSTEM_PATHS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")


class _Libc:
    """The few libc calls Python 3.11 lacks (``unshare``, ``mount``, ``pivot_root``...)."""

    def __init__(self) -> None:
        import ctypes

        self._ctypes = ctypes
        self.lib = ctypes.CDLL(None, use_errno=True)

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            errno = self._ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    def unshare(self, flags: int) -> None:
        self._check(self.lib.unshare(flags), "unshare")

    def mount(self, source: str | None, target: str, fs: str | None, flags: int, data=None):
        enc = lambda s: None if s is None else s.encode()  # noqa: E731
        result = self.lib.mount(enc(source), enc(target), enc(fs), flags, enc(data))
        self._check(result, f"mount {target}")

    def umount2(self, target: str, flags: int) -> None:
        self._check(self.lib.umount2(target.encode(), flags), f"umount {target}")

    def pivot_root(self, new: str, old: str) -> None:
        nr = _SYS_PIVOT_ROOT.get(os.uname().machine)
        if nr is None:
            raise OSError(0, f"pivot_root: unknown syscall number on {os.uname().machine}")
        self._check(self.lib.syscall(nr, new.encode(), old.encode()), "pivot_root")

    def prctl(self, option: int, value: int) -> None:
        self._check(self.lib.prctl(option, value, 0, 0, 0), "prctl")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _bind(libc: _Libc, root: str, source: str, writable_dev: bool = False) -> None:
    """Bind ``source`` read-only at the same path under ``root`` (a symlink stays a link)."""
    target = root + source
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if os.path.islink(source):
        if not os.path.lexists(target):
            os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        os.makedirs(target, mode=0o755, exist_ok=True)
    elif not os.path.exists(target):
        open(target, "w").close()
    libc.mount(source, target, None, _MS_BIND | _MS_REC)
    keep = os.statvfs(source).f_flag
    flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID
    flags |= 0 if writable_dev else _MS_NODEV
    flags |= sum(ms for st, ms in _KEEP if keep & st)
    libc.mount(None, target, None, flags)


def _build_root(libc: _Libc, settings: dict) -> None:
    """In the new mount namespace: the jail's root at ``settings["root"]``, then enter it."""
    root = settings["root"]
    libc.mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing propagates back to the host
    libc.mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    binds = [p for p in SYSTEM_PATHS if os.path.lexists(p)] + list(settings["binds"])
    for path in binds:
        if os.path.lexists(path):
            _bind(libc, root, path)
    if os.path.exists("/etc/ld.so.cache"):
        _bind(libc, root, "/etc/ld.so.cache")
    for dev in DEVICES:
        if os.path.exists(dev):
            _bind(libc, root, dev, writable_dev=True)
    box = root + SANDBOX
    os.makedirs(box, mode=0o755)
    size = f"size={int(settings['disk_mb'])}m,mode=0700,uid={UID if _root() else os.getuid()}"
    libc.mount("tmpfs", box, "tmpfs", _MS_NOSUID | _MS_NODEV, size + f",gid={_gid()}")
    os.makedirs(root + "/proc", mode=0o555)
    try:  # a proc of this PID namespace only
        libc.mount("proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    except OSError:  # the kernel refuses (a container masking parts of /proc): none at all
        os.rmdir(root + "/proc")
    os.chdir(root)
    libc.pivot_root(".", ".")
    libc.umount2(".", _MNT_DETACH)
    os.chdir("/")
    libc.mount(None, "/", None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _root() -> bool:
    return os.geteuid() == 0


def _gid() -> int:
    return UID if _root() else os.getgid()


def _enter_namespaces(libc: _Libc) -> None:
    """Unshare everything; a non-root caller first enters a user namespace of its own uid."""
    flags = _CLONE_NEWNS | _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS
    if not _root():
        uid, gid = os.geteuid(), os.getegid()
        libc.unshare(_CLONE_NEWUSER)
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    libc.unshare(flags)


def _run_code(settings: dict, status_fd: int, cwd: str, libc: _Libc | None) -> int:
    """Fork the code's process, wait for it, write its status; the exit code for ours."""
    pid = os.fork()
    if pid == 0:
        try:
            os.chdir(cwd)
            if libc is not None:
                libc.prctl(_PR_SET_PDEATHSIG, 9)
                libc.prctl(_PR_SET_NO_NEW_PRIVS, 1)
            argv = settings["argv"]
            os.execve(argv[0], argv, settings["env"])
        except BaseException as err:
            os.write(2, f"sandbox: cannot start the code: {err}\n".encode())
        os._exit(127)
    _, status, usage = os.wait4(pid, 0)
    cpu = usage.ru_utime + usage.ru_stime
    if os.WIFSIGNALED(status):
        report = f"signal {os.WTERMSIG(status)} {cpu:.3f}"
    else:
        report = f"code {os.waitstatus_to_exitcode(status)} {cpu:.3f}"
    os.write(status_fd, report.encode())
    return 0


def _error(status_fd: int, err: BaseException) -> int:
    os.write(status_fd, f"error {str(err) or type(err).__name__}".encode())
    return 1


def _drop() -> None:
    """As root: no groups, uid/gid 65534 (which clears every capability)."""
    os.setgroups([])
    os.setgid(UID)
    os.setuid(UID)


def _in_bwrap(settings: dict, status_fd: int) -> int:
    """Init of bubblewrap's PID namespace, on the root bwrap built: drop, run the code."""
    try:
        libc = _Libc()
        if _root():
            os.chown(SANDBOX, UID, UID)
            _drop()
        libc.prctl(_PR_SET_PDEATHSIG, 9)  # bwrap's --die-with-parent; a change of uid clears it
        return _run_code(settings, status_fd, SANDBOX, libc)
    except OSError as err:
        return _error(status_fd, err)


def main(settings: dict) -> int:
    """The launcher: see the module docstring. ``settings``: `encode`'s dict, from argv[1]."""
    status_fd = int(settings["status_fd"])
    os.set_inheritable(status_fd, False)  # never reaches the code
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if settings.get("bwrap"):
        return _in_bwrap(settings, status_fd)
    if not settings["jail"]:
        return _run_code(settings, status_fd, settings["cwd"], None)
    try:
        libc = _Libc()
        _enter_namespaces(libc)
    except OSError as err:
        return _error(status_fd, err)
    pid = os.fork()
    if pid == 0:  # init of the new PID namespace
        try:
            libc.prctl(_PR_SET_PDEATHSIG, 9)
            _build_root(libc, settings)
            if _root():
                _drop()
                libc.prctl(_PR_SET_PDEATHSIG, 9)  # a change of uid clears it
            code = _run_code(settings, status_fd, SANDBOX, libc)
        except OSError as err:
            code = _error(status_fd, err)
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return 0 if status == 0 else 1


def encode(settings: dict) -> str:
    """``settings`` as the launcher's argv[1] (marshal: no ``json`` import at its start-up)."""
    return marshal.dumps(settings).hex()


def parse_status(text: str) -> dict:
    """The launcher's report, ``"code N CPU"``, ``"signal S CPU"`` or ``"error WHY"``."""
    kind, _, rest = text.partition(" ")
    if kind == "error":
        return {"error": rest}
    if kind in ("code", "signal"):
        value, _, cpu = rest.partition(" ")
        try:
            return {kind: int(value), "cpu_s": float(cpu)}
        except ValueError:
            pass
    return {}


def interpreter_paths(python: str) -> list[str]:
    """The directories ``python`` needs (its prefixes and its executable's), as real paths."""
    import json
    import subprocess

    script = (
        "import sys, json; "
        "print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))"
    )
    out = subprocess.run([python, "-I", "-c", script], capture_output=True, text=True, check=True)
    paths = [*json.loads(out.stdout), os.path.dirname(python)]
    paths.append(os.path.dirname(os.path.realpath(python)))
    real = sorted({os.path.realpath(p) for p in paths} | {os.path.abspath(p) for p in paths})
    system = tuple(p + "/" for p in SYSTEM_PATHS)
    keep = [p for p in real if p not in SYSTEM_PATHS and not p.startswith(system)]
    # drop a path inside another (the outer bind shows it) and symlinked ones' duplicates
    keep = [p for p in keep if not any(p != q and p.startswith(q + "/") for q in keep)]
    return [p for p in keep if os.path.isdir(p) and not stat.S_ISLNK(os.lstat(p).st_mode)]


if __name__ == "__main__":
    sys.exit(main(marshal.loads(bytes.fromhex(sys.argv[1]))))
