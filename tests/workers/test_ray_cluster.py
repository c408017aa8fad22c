"""The Ray instance of a run: loopback only, gone after stop (or after its driver is killed),
joined clusters left running, and two Ray nodes on this machine placing one worker each."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import pytest

from lmrl.config import ResourcesConfig
from lmrl.workers.ray_cluster import RayCluster, RayError, free_port, ray_processes

ray = pytest.importorskip("ray")


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


def test_joining_an_address_with_no_cluster_fails_fast_with_the_key():
    address = f"127.0.0.1:{free_port()}"
    cluster = RayCluster(ResourcesConfig(ray_address=address), device="cpu")
    start = time.monotonic()
    with pytest.raises(RayError, match=r"resources\.ray_address"):
        cluster.start()
    assert time.monotonic() - start < 60
    assert not ray.is_initialized()


@pytest.mark.slow
def test_two_nodes_on_loopback_place_one_worker_each(two_ray_nodes):
    address, temp_dir = two_ray_nodes
    resources = replace(ResourcesConfig(), ray_address=address, nnodes=2, n_gpus_per_node=1)
    cluster = RayCluster(resources, device="cpu").start()
    try:
        group = cluster.placement_group(2, use_gpu=False, name="test")

        @ray.remote(num_cpus=1)
        def where():
            return ray.get_runtime_context().get_node_id()

        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        nodes = ray.get([
            where.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
            for i in range(2)
        ])  # fmt: skip
        assert len(set(nodes)) == 2
        ray.util.remove_placement_group(group)
    finally:
        cluster.stop()
    assert ray_processes(temp_dir)  # a joined cluster is left running
