"""The Ray instance of a run: started on loopback and stopped with the run, or joined.

``RayCluster(cfg.resources, device)``:

- with ``resources.ray_address`` unset, ``start`` runs a private Ray instance for this run:
  every server bound to ``127.0.0.1`` (Ray's single-machine mode), no dashboard, no usage
  report, its own short temp directory
  (``/tmp/lmrl-ray-<pid>-<n>``, which every one of its processes names on its command line).
  ``stop`` shuts it down and kills whatever process of that directory is left. A driver killed
  outright (SIGKILL) runs no ``finally``: a small reaper process, started with the instance in
  a session of its own, waits for the driver to die and then does the same cleanup.
- with ``resources.ray_address`` (``host:port`` of a running head, or ``auto``) it joins that
  cluster, and ``stop`` only disconnects: a cluster lmrl did not start is never stopped.

After start, the cluster must hold what ``resources`` asks for (``nnodes`` nodes,
``nnodes * n_gpus_per_node`` workers, a GPU each on CUDA or a CPU each otherwise); a shortfall
is an error that names it, before any worker starts. ``placement_group`` reserves one bundle
per worker, packed ``n_gpus_per_node`` to a node (``STRICT_PACK`` on one node, ``SPREAD``
over several) with a bounded wait.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from lmrl.errors import LmrlError

log = logging.getLogger("lmrl.workers")

__all__ = ["RayCluster", "RayError", "free_port", "node_ip", "ray_processes"]

_COUNTER = itertools.count()
PLACEMENT_TIMEOUT_S = 60.0


class RayError(LmrlError):
    """Ray is missing, cannot be reached, or the cluster cannot place the run's workers."""


def node_ip() -> str:
    """This process's node address as Ray sees it (127.0.0.1 for a local instance)."""
    import ray

    return ray.util.get_node_ip_address()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, and released: any process may take it before
    it is used (a process group meets at `lmrl.workers.dist.rendezvous_store` instead)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ray_processes(temp_dir: str) -> list[int]:
    """Pids of live processes of this instance: those whose command line names ``temp_dir``,
    and their descendants (the raylet's dashboard and runtime-env agents rename themselves
    ``ray::DashboardAgent``..., so their command lines no longer name it). Zombies excluded."""
    me, found = os.getpid(), []
    children: dict[int, list[int]] = {}  # parent pid -> its children's pids
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        if b"--reap" not in cmd and (temp_dir.encode() in cmd or _writes_in(entry, temp_dir)):
            found.append(int(entry))
    queue = list(found)
    while queue:
        for child in children.get(queue.pop(), []):
            if child not in found:
                found.append(child)
                queue.append(child)
    return found


def _writes_in(pid: str, temp_dir: str) -> bool:
    """The process holds a file of ``temp_dir`` open (an agent's log, after it renamed itself
    and left its parent's tree)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(temp_dir):
                return True
    return False


def kill_processes(temp_dir: str, timeout_s: float = 10.0) -> list[int]:
    """SIGTERM, then SIGKILL after ``timeout_s``, every process of ``temp_dir``; returns the
    pids still alive after that (none in practice)."""
    pids = ray_processes(temp_dir)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = [p for p in pids if _alive(p)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _needs_token(err: BaseException) -> bool:
    """Whether ``ray.init`` failed on Ray's token authentication (a cluster started with
    ``RAY_AUTH_MODE=token``).

    Ray 2.60 raises ``ConnectionError("Failed to connect to Ray cluster at ...")`` from a
    ``RuntimeError("Failed to connect to GCS. Last connection error: ...")`` whose text holds
    the ``AuthenticationError`` ("InvalidAuthToken: Authentication token is missing or
    incorrect"), so the whole chain of causes is read.
    """
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        text = str(cause).lower()
        if type(cause).__name__ == "AuthenticationError" or "unauthenticated" in text:
            return True
        if "authentication" in text and "token" in text:
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _token_hint() -> str:
    """What to set for a cluster with token authentication, given this process's settings."""
    mode = os.environ.get("RAY_AUTH_MODE")
    has = [k for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH") if os.environ.get(k)]
    if (Path.home() / ".ray" / "auth_token").is_file():  # where Ray looks last
        has.append("~/.ray/auth_token")
    if mode == "token" and has:
        return (
            f"the token this process gives ({' / '.join(has)}) is not the cluster's; set "
            "RAY_AUTH_TOKEN to the token the head was started with (`ray get-auth-token` on "
            "the head prints it)"
        )
    now = f"RAY_AUTH_MODE is {mode!r}" if mode else "RAY_AUTH_MODE is not set"
    return (
        f"this process has no valid token ({now}); set RAY_AUTH_MODE=token and "
        "RAY_AUTH_TOKEN=<the cluster's token> (or RAY_AUTH_TOKEN_PATH=<a file holding it>) in "
        "the environment of lmrl (`ray get-auth-token` on the head prints it)"
    )


def _unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """None when a TCP connection to ``host:port`` (or ``ray://host:port``) opens, else why
    not."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return "expected host:port (or auto)"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError as err:
        return f"nothing answers there ({err.strerror or err})"


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie is dead, waiting for its parent


_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _loopback_only(ray, on: bool) -> None:
    """Keep a private instance on 127.0.0.1, or undo that.

    Ray replaces a loopback ``node_ip_address`` by the machine's routable address so that
    other nodes can reach it, and binds its servers there. Its single-machine mode (what it
    uses on macOS and Windows) keeps every server on loopback: set through the environment for
    the processes the instance starts, and in the already imported constants of this one.
    """
    from ray._private import ray_constants

    if on:
        os.environ[_LOOPBACK_ENV] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
    else:
        os.environ.pop(_LOOPBACK_ENV, None)
        ray_constants.ENABLE_RAY_CLUSTER = True


class RayCluster:
    """Start (or join) Ray for one run, and make sure it is gone afterwards.

    Args:
        resources: the ``resources`` config section.
        device: ``trainer.device``: ``cuda`` places one GPU per worker, ``cpu`` one CPU
            process, ``auto`` GPUs when the cluster has enough of them.
        extra_workers: ranks beyond the actor's and critic's (an async run's rollout group).
    """

    def __init__(self, resources, device: str = "auto", extra_workers: int = 0) -> None:
        self.resources = resources
        self.extra_workers = extra_workers
        self.device = device
        self.address = resources.ray_address
        self.temp_dir: str | None = None
        self.reaper: subprocess.Popen | None = None
        self.use_gpu = False
        self.cpus_per_worker = 1
        self.started = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> RayCluster:
        """Start or join Ray, then check the cluster can hold the run's workers."""
        try:
            import ray
        except ImportError:
            raise RayError(
                "trainer.backend=ray needs Ray, which is not installed: pip install 'lmrl[ray]'"
            ) from None
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if ray.is_initialized():
            raise RayError("Ray is already initialized in this process; call ray.shutdown()")
        if self.address:
            self._join(ray)
        else:
            self._start_local(ray)
        self.started = True
        try:
            self._check_capacity(ray)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_local(self, ray) -> None:
        r = self.resources
        self.temp_dir = f"/tmp/lmrl-ray-{os.getpid()}-{next(_COUNTER)}"
        self.reaper = subprocess.Popen(
            [sys.executable, "-m", "lmrl.workers.ray_cluster", "--reap", str(os.getpid()),
             self.temp_dir],
            start_new_session=True, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        _loopback_only(ray, True)
        ray.init(
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            num_cpus=r.num_cpus,
            num_gpus=None if self.device != "cpu" else 0,
            _temp_dir=self.temp_dir,
            log_to_driver=True,
            configure_logging=False,
        )
        log.info("ray: started a local instance (%s)", self.temp_dir)

    def _join(self, ray) -> None:
        hint = ("start one with `ray start --head --node-ip-address=<ip> --port=6379`, or "
                "unset resources.ray_address for a local instance")  # fmt: skip
        from lmrl.config.checks import ray_address_problem  # not in the reaper's imports

        where = f"cannot join the Ray cluster at resources.ray_address={self.address!r}"
        malformed = ray_address_problem(self.address)
        if malformed:
            raise RayError(f"resources.ray_address={self.address!r} {malformed}")
        if self.address != "auto":
            problem = _unreachable(self.address)
            if problem:  # Ray itself would retry for minutes
                raise RayError(f"{where}: {problem}; {hint}")
        try:
            ray.init(address=self.address, log_to_driver=True, configure_logging=False)
        except Exception as err:
            if _needs_token(err):
                raise RayError(
                    f"{where}: the cluster requires token authentication and {_token_hint()}"
                ) from None
            if not isinstance(err, ConnectionError | RuntimeError | ValueError):
                raise
            raise RayError(f"{where}: {str(err).splitlines()[0]}; {hint}") from None
        log.info("ray: joined the cluster at %s", self.address)

    def _check_capacity(self, ray) -> None:
        r = self.resources
        workers = r.nnodes * r.n_gpus_per_node + max(0, getattr(r, "critic_workers", 0))
        workers += self.extra_workers
        total = ray.cluster_resources()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        gpus, cpus = int(total.get("GPU", 0)), int(total.get("CPU", 0))
        self.use_gpu = self.device == "cuda" or (self.device == "auto" and gpus >= workers)
        if len(nodes) < r.nnodes:
            raise RayError(
                f"resources.nnodes={r.nnodes} but the Ray cluster has {len(nodes)} node(s); "
                "start the missing nodes with `ray start --address=<head>` or lower nnodes"
            )
        have, kind = (gpus, "GPU") if self.use_gpu else (cpus, "CPU")
        if have < workers:
            raise RayError(
                f"the run needs {workers} worker(s) with a {kind} each (resources.nnodes * "
                f"resources.n_gpus_per_node), but the Ray cluster has {have} {kind}(s); lower "
                "resources.n_gpus_per_node or add resources (resources.num_cpus for a local "
                "instance)"
            )
        self.cpus_per_worker = 1
        if not self.use_gpu:  # a CPU worker gets its share of its node's CPUs as threads
            per_node = -(-workers // max(1, r.nnodes))
            smallest = min(int(n.get("Resources", {}).get("CPU", 0)) for n in nodes)
            self.cpus_per_worker = max(1, smallest // per_node)

    def stop(self) -> None:
        """Disconnect; stop the local instance and every process it left (idempotent)."""
        with contextlib.suppress(Exception):
            import ray

            if ray.is_initialized():
                ray.shutdown()
            if self.temp_dir is not None:
                _loopback_only(ray, False)
        if self.temp_dir is not None:
            left = kill_processes(self.temp_dir)
            if left:
                log.warning("ray: processes %s of %s did not stop", left, self.temp_dir)
        if self.reaper is not None:
            with contextlib.suppress(Exception):
                self.reaper.terminate()
                self.reaper.wait(timeout=5)
            self.reaper = None
        self.started = False

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ placement
    def placement_group(self, workers: int, use_gpu: bool, name: str = "lmrl"):
        """Reserve one bundle per worker: ``{"GPU": 1, "CPU": 1}`` or ``{"CPU": 1}``.

        Raises:
            RayError: the bundles cannot be placed within ``PLACEMENT_TIMEOUT_S`` seconds.
        """
        import ray
        from ray.util.placement_group import placement_group

        bundle = {"CPU": self.cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
        strategy = "STRICT_PACK" if self.resources.nnodes == 1 else "SPREAD"
        group = placement_group([dict(bundle) for _ in range(workers)], strategy=strategy,
                                name=f"{name}-{os.getpid()}")  # fmt: skip
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(group)
            raise RayError(
                f"Ray could not place {workers} {name} worker(s) of {bundle} within "
                f"{PLACEMENT_TIMEOUT_S:.0f}s ({strategy}); check `ray status` for free resources"
            )
        return group


def _reap(driver_pid: int, temp_dir: str) -> None:
    """Wait for the driver to die, then kill every process of its Ray instance."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the driver
    while _alive(driver_pid):
        time.sleep(0.5)
    kill_processes(temp_dir)


if __name__ == "__main__":  # python -m lmrl.workers.ray_cluster --reap PID TEMP_DIR
    if len(sys.argv) == 4 and sys.argv[1] == "--reap":
        _reap(int(sys.argv[2]), sys.argv[3])
