"""A real two-node Ray cluster on this machine: each node in its own network namespace, joined by
a bridge (``weight_sync.tools.bench.netns.ShapedCluster``, its links left unshaped), so the sync group
really crosses an interface. The job is submitted with ``ray job submit`` as a user would
(deploy/README.md), and must place workers on both nodes, verify every worker, and export its
metrics on the trainer node's Prometheus endpoint.

Needs root and ``ip netns`` (iproute2); elsewhere it is skipped with the reason. Ports: each node
is alone in a fresh namespace, where nothing else listens, so fixed ports cannot clash.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from weight_sync.tools.bench.netns import NetnsUnavailable, ShapedCluster, check_usable

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_PORT, METRICS_PORT = 8265, 8080

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def cluster() -> Iterator[ShapedCluster]:
    try:
        check_usable()
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    with ShapedCluster(2, None, dashboard_port=DASHBOARD_PORT, metrics_port=METRICS_PORT) as built:
        yield built


def metrics(cluster: ShapedCluster, node: int) -> str:
    """The node's Prometheus page, read from inside its namespace (only the nodes reach it)."""
    ip = cluster.plan.nodes[node].ip
    script = (f"import urllib.request; print(urllib.request.urlopen("
              f"'http://{ip}:{METRICS_PORT}/metrics', timeout=5).read().decode())")  # fmt: skip
    return cluster.run(node, [sys.executable, "-c", script], timeout=30, check=False).stdout


def test_job_submitted_to_a_two_node_cluster(cluster: ShapedCluster) -> None:
    head_ip = cluster.plan.head.ip
    submitted = cluster.run(0, [
        "ray", "job", "submit", f"--address=http://{head_ip}:{DASHBOARD_PORT}",
        f"--runtime-env={REPO / 'deploy' / 'runtime_env.yaml'}", "--",
        "python", "-m", "weight_sync.tools.ray_job", "--workers", "3", "--size-mb", "8", "--pushes", "3",
        "--spread", "--timeout", "120"], timeout=240, check=False,
    )  # fmt: skip
    output = submitted.stdout + submitted.stderr
    assert submitted.returncode == 0, output[-4000:]
    assert re.search(r"verified: 3/3 workers hold version 3, .* -- OK", output), output[-4000:]
    report = json.loads(re.search(r"^REPORT (.*)$", output, re.MULTILINE).group(1))
    trainer_ip = report["trainer_node"]["ip"]
    ips = {trainer_ip, *(node["ip"] for node in report["worker_nodes"])}
    assert ips == {node.ip for node in cluster.plan.nodes}  # the group crosses the link
    # One mixed push: workers beside the trainer through shared memory; on the other node the
    # first joins the group and relays to the rest there (SyncConfig.relay).
    far = [node["ip"] != trainer_ip for node in report["worker_nodes"]]
    expected = ["shm" if not away else "relay" if any(far[:i]) else "group"
                for i, away in enumerate(far)]  # fmt: skip
    assert report["routes"] == expected and set(expected) == {"shm", "group", "relay"}, report
    assert re.search(rf"group listens on {re.escape(trainer_ip)}\b", output), output[-4000:]
    trainer_node = next(node.index for node in cluster.plan.nodes if node.ip == trainer_ip)
    pushed, version = 0.0, None
    for _ in range(30):  # Ray exports custom metrics every few seconds, not all in one round
        text = metrics(cluster, trainer_node)
        found = re.findall(r"^ray_weight_sync_push_bytes_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
        pushed = sum(float(value) for value in found)
        version = re.search(r"^ray_weight_sync_version\{[^}]*\} 3\.0$", text, re.MULTILINE)
        if pushed and version:
            break
        time.sleep(1)
    assert pushed == 3 * 8_000_000 + 3 * 4 * 4096, "weight_sync metrics missing from Prometheus"
    assert version, text[-3000:]
