"""The Ray instance of a run: loopback only, gone after stop (or after its driver is killed),
joined clusters left running, and two Ray nodes on this machine placing one worker each."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lmrl.config import ResourcesConfig
from lmrl.workers.ray_cluster import RayCluster, RayError, free_port, ray_processes

ray = pytest.importorskip("ray")


def socket_server():
    """A listening socket on loopback: ``with socket_server() as port``."""
    import contextlib
    import socket

    @contextlib.contextmanager
    def serve():
        with socket.create_server(("127.0.0.1", 0)) as server:
            yield server.getsockname()[1]

    return serve()


def _wait_gone(temp_dir: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while ray_processes(temp_dir):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"Ray processes of {temp_dir} still alive: {ray_processes(temp_dir)}"
            )
        time.sleep(0.3)


def test_a_local_instance_is_loopback_only_and_gone_after_stop():
    cluster = RayCluster(ResourcesConfig(n_gpus_per_node=1, num_cpus=2), device="cpu")
    cluster.start()
    try:
        assert ray_processes(cluster.temp_dir)  # raylet, gcs_server, ...
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
        assert not cluster.use_gpu
        assert cluster.cpus_per_worker == 2  # one CPU worker: the node's CPUs as its threads
    finally:
        cluster.stop()
    assert not ray.is_initialized()
    _wait_gone(cluster.temp_dir, 5)
    cluster.stop()  # idempotent


def test_a_cluster_too_small_for_the_run_is_refused_and_stopped():
    cluster = RayCluster(ResourcesConfig(n_gpus_per_node=3, num_cpus=2), device="cpu")
    with pytest.raises(RayError, match=r"needs 3 worker.*has 2 CPU"):
        cluster.start()
    assert not ray.is_initialized()
    _wait_gone(cluster.temp_dir, 5)


def test_a_killed_driver_leaves_no_ray_process(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(
        textwrap.dedent("""
        import sys, time
        from lmrl.config import ResourcesConfig
        from lmrl.workers.ray_cluster import RayCluster
        cluster = RayCluster(ResourcesConfig(n_gpus_per_node=1, num_cpus=1), device="cpu")
        cluster.start()
        print(cluster.temp_dir, flush=True)
        time.sleep(600)
    """)
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    temp_dir = proc.stdout.readline().strip()
    assert temp_dir.startswith("/tmp/lmrl-ray-") and ray_processes(temp_dir)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _wait_gone(temp_dir, 30)  # the reaper noticed and cleaned up


def test_joining_an_address_with_no_cluster_fails_fast_with_the_key(monkeypatch):
    # refused by the port probe, before ray.init (which would retry for minutes)
    inits = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: inits.append(k))
    address = f"127.0.0.1:{free_port()}"
    cluster = RayCluster(ResourcesConfig(ray_address=address), device="cpu")
    with pytest.raises(RayError, match=r"resources\.ray_address=.*nothing answers there"):
        cluster.start()
    assert inits == []
    assert not ray.is_initialized()


@pytest.mark.parametrize(
    "address, expected",
    [
        ("http://127.0.0.1:8265", "is the URL of Ray's dashboard or job server"),
        ("127.0.0.1", "is not host:port"),
        ("grpc://127.0.0.1:6379", "has the scheme grpc://"),
    ],
)
def test_an_address_ray_cannot_join_is_named_before_ray_starts(address, expected):
    """issue 31 §4: a dashboard URL was blamed on name resolution."""
    cluster = RayCluster(ResourcesConfig(ray_address=address), device="cpu")
    with pytest.raises(RayError) as err:
        cluster.start()
    message = str(err.value)
    assert expected in message and "host:6379, ray://host:10001 (Ray Client) or auto" in message
    assert "\n" not in message and not ray.is_initialized()


def _ray_2_60_token_error() -> ConnectionError:
    """What ``ray.init(address=...)`` of Ray 2.60 raises when the cluster was started with
    ``RAY_AUTH_MODE=token`` and this process has no token or another one (seen against a
    real head): the authentication error is two causes down."""
    auth = (
        "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication token "
        "is missing or incorrect."
    )
    gcs = RuntimeError(f"Failed to connect to GCS. Last connection error: Traceback\n{auth}")
    try:
        raise ConnectionError("Failed to connect to Ray cluster at 192.0.2.2:6379") from gcs
    except ConnectionError as err:
        return err


@pytest.mark.parametrize(
    "error, env, expected",
    [
        (_ray_2_60_token_error, {}, "no valid token (RAY_AUTH_MODE is not set); set "
                                    "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<the cluster's token>"),
        (_ray_2_60_token_error, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "x" * 32},
         "the token this process gives (RAY_AUTH_TOKEN) is not the cluster's"),
        (lambda: ray.exceptions.AuthenticationError(
            "Token authentication is enabled but no authentication token was found"),
         {"RAY_AUTH_MODE": "token"}, "no valid token (RAY_AUTH_MODE is 'token'); set"),
    ],
)  # fmt: skip
def test_token_authentication_of_the_cluster_is_named_with_the_variable_to_set(
    error, env, expected, monkeypatch, tmp_path
):
    """issue 31 §4: a cluster started with RAY_AUTH_MODE=token refuses a driver without its
    token, and Ray says "Failed to connect": one line naming the token and RAY_AUTH_TOKEN (no
    Ray starts: ``ray.init`` is a stand-in that raises what Ray raises)."""
    from types import SimpleNamespace

    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    def init(**kwargs):
        raise error()

    with socket_server() as port:  # something answers at the address
        address = f"127.0.0.1:{port}"
        cluster = RayCluster(ResourcesConfig(ray_address=address), device="cpu")
        with pytest.raises(RayError) as err:
            cluster._join(SimpleNamespace(init=init))
    message = str(err.value)
    assert message.startswith(
        f"cannot join the Ray cluster at resources.ray_address={address!r}: the cluster "
        "requires token authentication and "
    )
    assert expected in message and "\n" not in message


def test_a_wrong_token_in_ray_s_default_file_is_named(monkeypatch, tmp_path):
    from lmrl.workers.ray_cluster import _token_hint

    for key in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("x" * 32)
    assert _token_hint().startswith("the token this process gives (~/.ray/auth_token) is not")


JOIN = """
from lmrl.config import ResourcesConfig
from lmrl.workers.ray_cluster import RayCluster, RayError
try:
    RayCluster(ResourcesConfig(ray_address={address!r}), device="cpu").start()
except RayError as err:
    print(err)
"""


@pytest.mark.slow
def test_joining_a_cluster_with_token_authentication_without_the_token(tmp_path):
    """A real head started with RAY_AUTH_MODE=token and a driver without a token (its own
    HOME: no ~/.ray/auth_token): Ray says only "Failed to connect", lmrl names the token."""
    import os
    from pathlib import Path

    from tests.conftest import ray_start, ray_start_port

    from lmrl.workers.ray_cluster import kill_processes

    temp_dir = f"/tmp/lmrl-ray-tok-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env |= {"RAY_USAGE_STATS_ENABLED": "0", "HOME": str(tmp_path)}
    ray_bin = str(Path(sys.executable).with_name("ray"))
    # every port one the system picks as the server binds it: a port found free first could
    # be taken by the GCS of a parallel test's local Ray, whose driver would then reach this
    # token-protected head
    head = ray_start(
        [ray_bin, "start", "--head", "--port=0", f"--temp-dir={temp_dir}",
         "--include-dashboard=false", "--node-ip-address=127.0.0.1", "--num-cpus=1",
         "--num-gpus=0", "--disable-usage-stats", "--min-worker-port=0",
         "--max-worker-port=0", "--dashboard-agent-listen-port=0"],
        env | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "a" * 32},
    )  # fmt: skip
    port = ray_start_port(head)
    try:
        code = textwrap.dedent(JOIN).format(address=f"127.0.0.1:{port}")
        # one connection attempt instead of Ray's 20 (1 s apart): the answer is the same
        driver = env | {"RAY_gcs_server_port_wait_time_s": "1"}
        done = subprocess.run([sys.executable, "-c", code], env=driver, capture_output=True,
                              text=True, timeout=300, check=False)  # fmt: skip
    finally:
        kill_processes(temp_dir)  # never `ray stop`: it stops every Ray process of the machine
        _wait_gone(temp_dir)
    assert done.stdout.startswith(
        f"cannot join the Ray cluster at resources.ray_address='127.0.0.1:{port}': the cluster "
        "requires token authentication and this process has no valid token (RAY_AUTH_MODE is "
        "not set); set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN="
    ), done.stdout + done.stderr[-2000:]


def test_a_connection_error_without_authentication_keeps_its_own_words():
    from types import SimpleNamespace

    def init(**kwargs):
        raise ConnectionError("Failed to connect to Ray cluster at 192.0.2.2:6379") from (
            RuntimeError("Failed to connect to GCS within 60 seconds")
        )

    with socket_server() as port:
        cluster = RayCluster(ResourcesConfig(ray_address=f"127.0.0.1:{port}"), device="cpu")
        with pytest.raises(RayError) as err:
            cluster._join(SimpleNamespace(init=init))
    assert "Failed to connect to Ray cluster" in str(err.value)
    assert "token" not in str(err.value)


def test_ray_client_addresses_are_probed_without_their_scheme():
    from lmrl.workers.ray_cluster import _unreachable

    with socket_server() as port:
        assert _unreachable(f"ray://127.0.0.1:{port}") is None


@pytest.fixture
def ray_token_at_home(tmp_path, monkeypatch):
    """A machine where a local ``ray.init`` ran before (it writes ``~/.ray/auth_token``), and
    a process that has not set ``RAY_AUTH_MODE``: a head started there turns token
    authentication on by itself, a node joining it does not."""
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("a" * 32)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)


PLACE = """
from dataclasses import replace

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from lmrl.config import ResourcesConfig
from lmrl.workers.ray_cluster import RayCluster

resources = replace(ResourcesConfig(), ray_address={address!r}, nnodes=2, n_gpus_per_node=1)
cluster = RayCluster(resources, device="cpu").start()
try:
    group = cluster.placement_group(2, use_gpu=False, name="test")

    @ray.remote(num_cpus=1)
    def where():
        return ray.get_runtime_context().get_node_id()

    nodes = ray.get([
        where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
        for i in range(2)
    ])
    print(len(set(nodes)))
    ray.util.remove_placement_group(group)
finally:
    cluster.stop()
"""


@pytest.mark.slow
def test_two_nodes_on_loopback_place_one_worker_each(ray_token_at_home, two_ray_nodes):
    """Whether a Ray token is at home or not (it is here): the second node joins. The driver
    runs in a process of its own: Ray keeps the token it read first for the life of a process,
    and this one's home is the fixture's."""
    import os

    address, temp_dir = two_ray_nodes
    code = textwrap.dedent(PLACE).format(address=address)
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.stdout.strip().splitlines()[-1:] == ["2"], done.stdout + done.stderr[-3000:]
    assert ray_processes(temp_dir)  # a joined cluster is left running
