"""A real two-node Ray cluster on this machine: each node in its own network namespace, joined by
a veth pair, so the sync group really crosses an interface. The job is submitted with
``ray job submit`` as a user would (deploy/README.md), and must place workers on both nodes,
verify every worker, and export its metrics on the trainer node's Prometheus endpoint.

Needs root and ``ip netns`` (iproute2); elsewhere it is skipped with the reason. Ports: each node
is alone in a fresh namespace, where nothing else listens, so fixed ports cannot clash.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
GCS_PORT, DASHBOARD_PORT, METRICS_PORT = 6379, 8265, 8080

pytestmark = pytest.mark.timeout(300)


def _netns_usable() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 (ip netns)"
    probe = f"wsprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Node:
    netns: str
    ip: str
    token: str  # the cluster's auth token: Ray 2.60 enforces token auth on `ray start` clusters


    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
               "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
               "RAY_USAGE_STATS_ENABLED": "0"}  # fmt: skip
        return subprocess.run(["ip", "netns", "exec", self.netns, *args], env=env, timeout=timeout,
                              capture_output=True, text=True, check=check)  # fmt: skip

    def metrics(self) -> str:
        # Read from inside the namespace: only the nodes can reach each other.
        script = (f"import urllib.request; print(urllib.request.urlopen("
                  f"'http://{self.ip}:{METRICS_PORT}/metrics', timeout=5).read().decode())")  # fmt: skip
        return self.run(sys.executable, "-c", script, timeout=30, check=False).stdout


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture
def cluster() -> Iterator[list[Node]]:
    reason = _netns_usable()
    if reason:
        pytest.skip(reason)
    tag = secrets.token_hex(3)
    subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    # A token of the cluster's own, never ~/.ray/auth_token: a fresh machine has none.
    token = secrets.token_hex(32)
    nodes = [Node(f"ws{tag}h", f"{subnet}.1", token), Node(f"ws{tag}w", f"{subnet}.2", token)]
    links = [f"ws{tag}h0", f"ws{tag}w0"]
    temp = Path(tempfile.mkdtemp(prefix="ws_ray_"))
    try:
        for node in nodes:
            _sh("ip", "netns", "add", node.netns)
        _sh("ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for node, link in zip(nodes, links, strict=True):
            _sh("ip", "link", "set", link, "netns", node.netns)
            _sh("ip", "netns", "exec", node.netns, "ip", "addr", "add", f"{node.ip}/24", "dev", link)
            _sh("ip", "netns", "exec", node.netns, "ip", "link", "set", link, "up")
            _sh("ip", "netns", "exec", node.netns, "ip", "link", "set", "lo", "up")
        head, worker = nodes
        head.run("ray", "start", "--head", f"--node-ip-address={head.ip}", f"--port={GCS_PORT}",
                 f"--dashboard-host={head.ip}", f"--dashboard-port={DASHBOARD_PORT}",
                 f"--metrics-export-port={METRICS_PORT}", "--num-cpus=1",
                 "--include-dashboard=true", f"--temp-dir={temp}")  # fmt: skip
        worker.run("ray", "start", f"--address={head.ip}:{GCS_PORT}", f"--node-ip-address={worker.ip}",
                   f"--metrics-export-port={METRICS_PORT}", "--num-cpus=1")  # fmt: skip
        yield nodes
    finally:
        for node in nodes:  # everything the nodes started lives in their namespaces
            pids = subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True,
                                  text=True).stdout.split()  # fmt: skip
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)
        shutil.rmtree(temp, ignore_errors=True)


def test_job_submitted_to_a_two_node_cluster(cluster: list[Node]) -> None:
    head, worker = cluster
    submitted = head.run(
        "ray", "job", "submit", f"--address=http://{head.ip}:{DASHBOARD_PORT}",
        f"--runtime-env={REPO / 'deploy' / 'runtime_env.yaml'}", "--",
        "python", "-m", "weight_sync.job", "--workers", "3", "--size-mb", "8", "--pushes", "3",
        "--spread", "--timeout", "120", timeout=240, check=False,
    )  # fmt: skip
    output = submitted.stdout + submitted.stderr
    assert submitted.returncode == 0, output[-4000:]
    assert re.search(r"verified: 3/3 workers hold version 3, .* -- OK", output), output[-4000:]
    report = json.loads(re.search(r"^REPORT (.*)$", output, re.MULTILINE).group(1))
    trainer_ip = report["trainer_node"]["ip"]
    ips = {trainer_ip, *(node["ip"] for node in report["worker_nodes"])}
    assert ips == {head.ip, worker.ip}  # both nodes hold actors: the group crosses the veth
    # One mixed push: workers beside the trainer through shared memory; on the other node the
    # first joins the group and relays to the rest there (SyncConfig.relay).
    far = [node["ip"] != trainer_ip for node in report["worker_nodes"]]
    expected = ["shm" if not away else "relay" if any(far[:i]) else "group"
                for i, away in enumerate(far)]  # fmt: skip
    assert report["routes"] == expected and set(expected) == {"shm", "group", "relay"}, report
    assert re.search(rf"group listens on {re.escape(trainer_ip)}\b", output), output[-4000:]
    trainer_node = head if trainer_ip == head.ip else worker
    pushed = 0.0
    for _ in range(30):  # Ray exports custom metrics every few seconds
        text = trainer_node.metrics()
        found = re.findall(r'^ray_weight_sync_push_bytes_total\{[^}]*\} (\S+)$', text, re.MULTILINE)
        pushed = sum(float(value) for value in found)
        if pushed:
            break
        time.sleep(1)
    assert pushed == 3 * 8_000_000 + 3 * 4 * 4096, "weight_sync metrics missing from Prometheus"
    assert re.search(r'^ray_weight_sync_version\{[^}]*\} 3\.0$', text, re.MULTILINE)
