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
import subprocess
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


def watch_version(cluster: ShapedCluster, node: int, version: int) -> subprocess.Popen[str]:
    """A process inside node ``node`` that reads its metrics page every second and prints
    ``seen`` (then ends) once ``weight_sync_version`` reads ``version`` there."""
    ip = cluster.plan.nodes[node].ip
    script = (
        "import re, time, urllib.request\n"
        f"pattern = re.compile(r'^ray_weight_sync_version{{[^}}]*}} {version}\\.0$', re.M)\n"
        "while True:\n"
        "    try:\n"
        f"        page = urllib.request.urlopen('http://{ip}:{METRICS_PORT}/metrics', timeout=5)\n"
        "        if pattern.search(page.read().decode()):\n"
        "            print('seen', flush=True)\n"
        "            break\n"
        "    except OSError:\n"
        "        pass\n"
        "    time.sleep(1)\n"
    )
    return subprocess.Popen(
        cluster.command(node, [sys.executable, "-c", script]),
        env=cluster.env(),
        stdout=subprocess.PIPE,
        text=True,
    )


def test_job_submitted_to_a_two_node_cluster(cluster: ShapedCluster, tmp_path: Path) -> None:
    head_ip = cluster.plan.head.ip
    submit = cluster.command(0, [
        "ray", "job", "submit", f"--address=http://{head_ip}:{DASHBOARD_PORT}",
        f"--runtime-env={REPO / 'deploy' / 'runtime_env.yaml'}", "--",
        "python", "-m", "weight_sync.tools.ray_job", "--workers", "3", "--size-mb", "8", "--pushes", "3",
        "--spread", "--timeout", "120"],
    )  # fmt: skip
    # A gauge is on a metrics page only while the actor that sets it reports (Ray 2.60 drops it
    # two export intervals after its process ends: open_telemetry_metric_recorder's gauge TTL),
    # and the trainer ends with the job: the pages are read while the job runs.
    watchers = [watch_version(cluster, node.index, 3) for node in cluster.plan.nodes]
    log = tmp_path / "submit.log"
    try:
        with log.open("w") as out:
            job = subprocess.run(submit, env=cluster.env(), stdout=out, stderr=subprocess.STDOUT,
                                 timeout=240, check=False)  # fmt: skip
        output = log.read_text()
        report_line = re.search(r"^REPORT (.*)$", output, re.MULTILINE)
        trainer_ip = json.loads(report_line.group(1))["trainer_node"]["ip"] if report_line else ""
        trainer_node = next((n.index for n in cluster.plan.nodes if n.ip == trainer_ip), 0)
        try:  # a gauge outlives its process by two export intervals
            seen = watchers[trainer_node].communicate(timeout=30)[0].strip() == "seen"
        except subprocess.TimeoutExpired:
            seen = False
    finally:
        for watcher in watchers:
            watcher.kill()
            watcher.wait(timeout=10)
    assert job.returncode == 0, output[-4000:]
    assert re.search(r"verified: 3/3 workers hold version 3, .* -- OK", output), output[-4000:]
    assert report_line is not None, output[-4000:]
    report = json.loads(report_line.group(1))
    ips = {trainer_ip, *(node["ip"] for node in report["worker_nodes"])}
    assert ips == {node.ip for node in cluster.plan.nodes}  # the group crosses the link
    # One mixed push: workers beside the trainer through shared memory; on the other node the
    # first joins the group and relays to the rest there (SyncConfig.relay).
    far = [node["ip"] != trainer_ip for node in report["worker_nodes"]]
    expected = ["shm" if not away else "relay" if any(far[:i]) else "group"
                for i, away in enumerate(far)]  # fmt: skip
    assert report["routes"] == expected and set(expected) == {"shm", "group", "relay"}, report
    assert re.search(rf"group listens on {re.escape(trainer_ip)}\b", output), output[-4000:]
    pushed, expected_bytes = 0.0, 3 * 8_000_000 + 3 * 4 * 4096
    for _ in range(30):  # Ray exports custom metrics every few seconds; counters stay
        text = metrics(cluster, trainer_node)
        found = re.findall(r"^ray_weight_sync_push_bytes_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
        pushed = sum(float(value) for value in found)
        if pushed == expected_bytes:
            break
        time.sleep(1)
    assert pushed == expected_bytes, "weight_sync metrics missing from Prometheus"
    assert seen, f"the version gauge never read 3 on the trainer node's page: {text[-3000:]}"
