"""Ray's own autoscaler on one machine: a head with 0 CPUs and the `fake_multinode` provider,
whose worker node types are CPU-only stand-ins for `cluster.yaml`'s GPU node types.

A stand-in of a node type with G GPUs declares G CPUs and G units of `STANDIN_RESOURCE`
(one stage actor per GPU, as on the real node), so a job aims its stages at the stand-ins
with `--stage-resources '{"rrfp_standin": 1}'`. The fake nodes are processes on this
machine that share its filesystem.

Every process of the cluster (the head's and those of the nodes the autoscaler adds)
runs under the cluster's own temp dir; `stop` ends exactly those, by pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
STANDIN_RESOURCE = "rrfp_standin"
HEAD_NODE_ID = "fffffffffffffffffffffffffffffffffffffffffffffffffff00000"  # the provider's fixed head id


def standin_node_types(*, cluster_yaml: Path, max_workers: int, only: Collection[str] | None = None) -> dict:
    """cluster.yaml's worker node types (those named in `only`, if given) as CPU-only stand-ins
    (at most `max_workers` nodes each)."""
    config = yaml.safe_load(cluster_yaml.read_text())
    types = {}
    for name, node_type in config["available_node_types"].items():
        if name == config["head_node_type"] or (only is not None and name not in only):
            continue
        gpus = int(node_type["resources"].get("GPU", 0))
        if gpus:
            types[name] = {
                "resources": {"CPU": gpus, STANDIN_RESOURCE: gpus},
                "node_config": {},
                "min_workers": 0,
                "max_workers": min(max_workers, node_type.get("max_workers", max_workers)),
            }
    return types


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class FakeCluster:
    temp_dir: Path
    gcs_address: str
    dashboard_url: str
    env: dict[str, str]  # for the `ray` CLI against this cluster (RAY_ADDRESS, token auth, the venv's PATH)
    home: Path  # HOME of the head and of its jobs (a job's default --out lies under it)

    @classmethod
    def start(
        cls,
        *,
        idle_timeout_minutes: float = 0.1,
        max_workers: int = 2,
        node_types: Collection[str] | None = None,
        attempts: int = 2,
    ) -> FakeCluster:
        """Start the head (the venv's `python` first on PATH, so jobs run the project's Python), with
        stand-ins of cluster.yaml's GPU node types (of `node_types` only, if given). A head whose raylet
        does not register within Ray's fixed 30 s (a loaded machine) is ended and started afresh, up to
        `attempts` times."""
        options = {"idle_timeout_minutes": idle_timeout_minutes, "max_workers": max_workers, "only": node_types}
        for _ in range(attempts - 1):
            try:
                return cls._start_head(**options)
            except RuntimeError as error:
                print(f"fake cluster: starting the head again after: {str(error)[-300:]}", file=sys.stderr)
        return cls._start_head(**options)

    @classmethod
    def _start_head(cls, *, idle_timeout_minutes: float, max_workers: int, only: Collection[str] | None) -> FakeCluster:
        temp_dir = Path(tempfile.mkdtemp(prefix="rrfp-fake-", dir="/tmp"))
        ip = "127.0.0.1"
        gcs_port, dashboard_port = free_port(), free_port()
        gcs_address = f"{ip}:{gcs_port}"
        node_types = standin_node_types(cluster_yaml=ROOT / "cluster.yaml", max_workers=max_workers, only=only)
        node_types["ray.head.default"] = {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0}
        config = {
            "cluster_name": "rrfp-fake",
            "max_workers": max_workers * len(node_types),
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": idle_timeout_minutes,
            "provider": {
                "type": "fake_multinode",
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
                "gcs_address": gcs_address,  # the worker nodes dial the head's GCS here, not on 6379
            },
            "auth": {"ssh_user": "ubuntu"},
            "available_node_types": node_types,
            "head_node_type": "ray.head.default",
            "file_mounts": {},
            **{
                key: []
                for key in (
                    "cluster_synced_files",
                    "initialization_commands",
                    "setup_commands",
                    "head_setup_commands",
                    "worker_setup_commands",
                    "head_start_ray_commands",
                    "worker_start_ray_commands",
                )
            },
        }
        (temp_dir / "autoscaling.yaml").write_text(yaml.safe_dump(config))
        venv_bin = str(Path(sys.executable).parent)
        home = temp_dir / "home"
        home.mkdir()
        env = {
            **os.environ,
            "HOME": str(home),
            "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}",
            "RAY_AUTH_MODE": "token",
            "RAY_FAKE_CLUSTER": "1",
            "RAY_OVERRIDE_NODE_ID_FOR_TESTING": HEAD_NODE_ID,
        }
        env.pop("RAY_ADDRESS", None)
        env.pop("PYTHONPATH", None)  # a job finds the project in its working dir, as on a real cluster
        ports = {
            "--port": gcs_port,
            "--dashboard-port": dashboard_port,
            "--ray-client-server-port": free_port(),
            "--dashboard-agent-listen-port": free_port(),
            "--dashboard-agent-grpc-port": free_port(),
            "--metrics-export-port": free_port(),
            "--runtime-env-agent-port": free_port(),
        }
        subprocess.run(  # a token of this cluster's own, in its HOME
            [f"{venv_bin}/ray", "get-auth-token", "--generate"], env=env, check=True, capture_output=True, timeout=60
        )
        started = subprocess.run(
            [f"{venv_bin}/ray", "start", "--head", f"--node-ip-address={ip}", "--num-cpus=0",
             f"--temp-dir={temp_dir}", "--dashboard-host=127.0.0.1", "--include-dashboard=true",
             f"--autoscaling-config={temp_dir / 'autoscaling.yaml'}",
             *(f"{flag}={port}" for flag, port in ports.items())],
            env=env, check=False, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        if started.returncode != 0:
            _end_processes(temp_dir=temp_dir)
            raise RuntimeError(f"ray start --head failed:\n{started.stdout[-2000:]}\n{started.stderr[-2000:]}")
        env.pop("RAY_OVERRIDE_NODE_ID_FOR_TESTING")
        env.pop("RAY_FAKE_CLUSTER")
        url = f"http://{ip}:{dashboard_port}"
        return cls(
            temp_dir=temp_dir,
            gcs_address=gcs_address,
            dashboard_url=url,
            env=env | {"RAY_ADDRESS": gcs_address},
            home=home,
        )

    def set_max_workers(self, max_workers: int) -> None:
        """Cap every stand-in node type at `max_workers` nodes: the autoscaler reads its config again each
        round, terminates the nodes over a lower cap and adds none beyond it."""
        path = self.temp_dir / "autoscaling.yaml"
        config = yaml.safe_load(path.read_text())
        for name, node_type in config["available_node_types"].items():
            if name != config["head_node_type"]:
                node_type["max_workers"] = max_workers
        config["max_workers"] = max_workers * len(config["available_node_types"])
        written = path.with_name(f".{path.name}.tmp")
        written.write_text(yaml.safe_dump(config))
        os.replace(written, path)  # whole: the autoscaler may read it at any time

    def pids(self) -> list[int]:
        return _pids(temp_dir=self.temp_dir)

    def stop(self) -> None:
        _end_processes(temp_dir=self.temp_dir)

    def ray(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """The `ray` CLI against this cluster."""
        ray = Path(sys.executable).parent / "ray"
        return subprocess.run(
            [str(ray), *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )

    def worker_nodes(self) -> tuple[int, int]:
        """Worker nodes (besides the head) alive now, and ever registered (from the GCS)."""
        out = subprocess.run(
            [sys.executable, "-c", _COUNT_NODES], env=self.env, capture_output=True, text=True, timeout=60, check=True
        )
        alive, ever = out.stdout.strip().splitlines()[-1].split()
        return int(alive), int(ever)

    def wait_for(self, predicate, *, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"fake cluster: waited {timeout_s:g} s for {what}")
            time.sleep(2)


def _pids(*, temp_dir: Path) -> list[int]:
    """The processes of a cluster: those whose command line names its temp dir (the session's
    sockets and logs live there)."""
    marker = str(temp_dir).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # gone meanwhile
                continue
    return found


def _end_processes(*, temp_dir: Path) -> None:
    """End a cluster's processes by pid (SIGTERM, then SIGKILL), never `ray stop`, and remove its temp dir."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _pids(temp_dir=temp_dir):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while _pids(temp_dir=temp_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
    shutil.rmtree(temp_dir, ignore_errors=True)


_COUNT_NODES = f"""
import ray
ray.init(address="auto", log_to_driver=False)
workers = [n for n in ray.nodes() if n["NodeID"] != "{HEAD_NODE_ID}"]
print(sum(1 for n in workers if n["Alive"]), len(workers))
"""
