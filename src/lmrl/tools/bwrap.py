"""The python tool's jail built by bubblewrap (``bwrap``), when it is installed and works.

bubblewrap is the field's well-kept setuid-free sandbox (Flatpak's): it makes the namespaces,
the tmpfs root, the read-only binds and ``/proc``; `lmrl.tools.jail`'s launcher then runs
inside it as PID 1 (``--as-pid-1``) and does only the rest (the drop to uid 65534, the code's
process, its status), so the code's limits, seccomp filter, audit hook and death reports are
the same ones as under `lmrl.tools.jail`'s own namespaces.

- As root, bwrap runs without a user namespace (a user namespace of root's would map the
  code's uid 65534 onto the host's root): new PID, mount, network, IPC, UTS and cgroup
  namespaces, and the launcher keeps only ``CAP_SETUID``, ``CAP_SETGID`` and ``CAP_CHOWN``,
  enough to give ``/sandbox`` to 65534 and drop to it (which clears them).
- Otherwise ``--unshare-all`` with a user namespace of the caller's own uid, as the
  namespaces of `lmrl.tools.jail` do.

No ``--seccomp`` filter of bwrap's: it would have to allow the launcher's one ``execve`` of
the runner; the runner installs the filter that refuses ``exec`` itself, after it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

from lmrl.tools.jail import DEVICES, SANDBOX, SYSTEM_PATHS

__all__ = ["command", "version"]

INSIDE = "/.lmrl-jail.py"  # where the launcher's file is mounted in the jail
_ROOT_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_CHOWN")


@functools.cache
def version(path: str) -> tuple[str, str]:
    """``(version, why_not)`` of the ``bwrap`` at ``path``: ``why_not`` is empty when it has
    every option the jail needs (``--size`` for the disk quota came with 0.8.0)."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
        usage = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as err:
        return "", f"{path} does not run: {err}"
    first = (out.stdout.strip().splitlines() or [""])[0]
    text = first.removeprefix("bubblewrap").strip() or "(unknown version)"
    missing = [o for o in ("--size", "--perms", "--as-pid-1") if o not in usage.stdout]
    if missing:
        return text, f"bwrap {text} lacks {', '.join(missing)} (0.8.0 or later is needed)"
    return text, ""


def which() -> str | None:
    """The ``bwrap`` on ``PATH``, if any."""
    return shutil.which("bwrap")


def command(bwrap: str, launcher: str, binds: list[str], disk_mb: int) -> list[str]:
    """The argv that starts bubblewrap's jail; append the launcher's command line to it.

    Args:
        bwrap: the ``bwrap`` executable.
        launcher: the file of `lmrl.tools.jail`, mounted read-only at `INSIDE`.
        binds: the interpreter's directories (`lmrl.tools.jail.interpreter_paths`), read-only.
        disk_mb: the size of ``/sandbox``'s tmpfs, MiB.
    """
    argv = [bwrap, "--die-with-parent", "--new-session", "--as-pid-1"]
    if os.geteuid() == 0:
        argv += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
        argv += ["--unshare-cgroup-try", "--cap-drop", "ALL"]
        for cap in _ROOT_CAPS:
            argv += ["--cap-add", cap]
    else:
        argv += ["--unshare-all"]
    paths = [p for p in SYSTEM_PATHS if os.path.lexists(p)] + list(binds)
    above = {os.path.dirname(p) for p in [*paths, *DEVICES, "/etc/ld.so.cache"]}
    above = {a for p in above for a in _ancestors(p)}
    for path in sorted(above, key=lambda p: p.count("/")):  # 0755, not bwrap's 0700
        argv += ["--perms", "0755", "--dir", path]
    for path in paths:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for dev in DEVICES:
        argv += ["--dev-bind-try", dev, dev]
    argv += ["--proc", "/proc", "--ro-bind", launcher, INSIDE]
    argv += ["--perms", "0700", "--size", str(int(disk_mb) << 20), "--tmpfs", SANDBOX]
    argv += ["--remount-ro", "/", "--chdir", SANDBOX, "--"]
    return argv


def _ancestors(path: str) -> list[str]:
    """``/a/b`` -> ``["/a", "/a/b"]`` (``/`` itself excluded)."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]
