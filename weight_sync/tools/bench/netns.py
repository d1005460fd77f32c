"""A multi-node Ray cluster on one machine: each node in its own network namespace, every node's
link shaped to a chosen rate, so a push really crosses links of a known speed.

The topology is a switch with one port per node::

    netns node0 (eth0 10.A.B.1) ══veth══ wsbr<tag> (a Linux bridge in the root namespace)
    netns node1 (eth0 10.A.B.2) ══veth══╝ ...

Each veth is shaped at both ends with a token bucket (``tc ... tbf``): the node's own end
limits what the node sends, the root end (which sends into the node) what it receives -- a
full-duplex NIC of that rate, as a cloud VM's. ``delay_ms`` adds a ``netem`` delay on the node's
egress only, so one node reaches another after ``delay_ms`` (and the round trip takes twice
that). Inside every namespace the link is named ``eth0``, so the trainer reads its own link's
counters and the sync group binds by one interface name on every node.

With no rate (``rate_bits=None``) the links are left unshaped: the deploy test's cluster, which
also asks for the head's dashboard (``ray job submit``) and every node's metrics port.

Every node is a real ``ray start`` node (the head on node 0) with a custom resource
``ws_node_<k>`` that pins actors to it. Everything is torn down on exit, failure and
KeyboardInterrupt included: every process of every namespace is killed (Ray daemonizes, so
``ip netns pids`` -- not a process tree -- is what finds them all), then the namespaces and
the bridge are deleted (deleting a namespace deletes its veth, and with it the root end).

Needs root, iproute2 (``ip``) and ``tc``: :func:`check_usable` says which is missing. The pure
functions (rates, bursts, command lines) are tested on their own (tests/unit/test_netns_plan.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from typing_extensions import Self

logger = logging.getLogger(__name__)

MAX_NODES = 8  # K trainer nodes and a node of workers, K up to 4 (bench/senders.py)
GCS_PORT = 6379
NODE_LINK = "eth0"  # the link's name inside every node's namespace
MIN_BURST = 64 << 10  # a token bucket needs at least a few full packets (and GSO segments)
QUEUE_LATENCY_MS = 50  # how long a packet may wait in the token bucket before it is dropped

_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$")


class NetnsUnavailable(RuntimeError):
    """This machine cannot build a shaped cluster (not root, no iproute2 / tc, no netns)."""


def parse_rate(text: str) -> int:
    """A tc rate (``100mbit``, ``10gbit``, ``125mbps`` = bytes) in bits per second. Only
    explicit units: tc reads a bare number as bytes, which nobody means."""
    match = _RATE.match(text.lower())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(
            f"rate {text!r} is not a tc rate: write a number and a unit, e.g. '100mbit', "
            f"'1gbit', '10gbit' (units: {', '.join(_UNITS)})"
        )
    bits = float(match.group(1)) * _UNITS[match.group(2)]
    if bits < 1e5:
        raise ValueError(f"rate {text!r} is below 100kbit: a push would take hours; raise it")
    return int(bits)


def format_rate(bits: int) -> str:
    """``10**9`` -> ``'1gbit'``: how the report names a rate."""
    for unit, scale in (("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale and bits % scale == 0:
            return f"{bits // scale}{unit}"
    return f"{bits}bit"


def burst_bytes(rate_bits: int) -> int:
    """The token bucket's size: 4 ms of traffic at the rate, at least 64 KiB. Smaller buckets
    cannot hold a GSO segment (64 KiB) and throttle fast links far below their rate; much
    larger ones let short transfers run at memory speed."""
    return max(MIN_BURST, rate_bits // 8 // 250)


def netem_limit(rate_bits: int, delay_ms: float) -> int:
    """netem's queue in packets: twice what is in flight during the delay at full rate (its
    default of 1000 drops packets on a fast, long link), at least 1000."""
    in_flight = rate_bits / 8 * delay_ms / 1000 / 1500
    return max(1000, math.ceil(2 * in_flight))


def shape_commands(
    device: str, rate_bits: int, delay_ms: float = 0.0, netns: str | None = None
) -> list[list[str]]:
    """The tc command lines that shape ``device`` (in ``netns``, if given) to ``rate_bits``, with
    a netem delay in front of the token bucket when ``delay_ms`` > 0."""
    if delay_ms < 0:
        raise ValueError(f"delay_ms must be >= 0 (got {delay_ms}); 0 adds no delay")
    prefix = ["ip", "netns", "exec", netns] if netns else []
    tbf = [
        "tbf",
        "rate",
        f"{rate_bits}bit",
        "burst",
        str(burst_bytes(rate_bits)),
        "latency",
        f"{QUEUE_LATENCY_MS}ms",
    ]
    if delay_ms <= 0:
        return [[*prefix, "tc", "qdisc", "add", "dev", device, "root", *tbf]]
    netem = ["netem", "delay", f"{delay_ms:g}ms", "limit", str(netem_limit(rate_bits, delay_ms))]
    return [
        [*prefix, "tc", "qdisc", "add", "dev", device, "root", "handle", "1:", *netem],
        [*prefix, "tc", "qdisc", "add", "dev", device, "parent", "1:", "handle", "2:", *tbf],
    ]


@dataclass(frozen=True)
class NodeSpec:
    """One node: its namespace, its address, and its link's name on the root (bridge) side."""

    index: int
    netns: str
    ip: str
    host_link: str

    @property
    def resource(self) -> str:
        """The custom Ray resource that pins actors to this node."""
        return node_resource(self.index)


def node_resource(index: int) -> str:
    return f"ws_node_{index}"


@dataclass(frozen=True)
class ClusterPlan:
    """Names, addresses and the command lines that build the shaped network (pure)."""

    tag: str
    nodes: tuple[NodeSpec, ...]
    bridge: str
    rate_bits: int | None  # None: links unshaped
    delay_ms: float = 0.0
    dashboard_port: int | None = None  # the head's dashboard (job submission), on its address
    metrics_port: int | None = None  # every node's Prometheus export
    node_rates: tuple[int, ...] = ()  # a rate per node, overriding rate_bits (a wider node)

    def rate_of(self, node: NodeSpec) -> int | None:
        return self.node_rates[node.index] if self.node_rates else self.rate_bits

    @property
    def head(self) -> NodeSpec:
        return self.nodes[0]

    @property
    def address(self) -> str:
        """The Ray GCS address, as reached from inside any node."""
        return f"{self.head.ip}:{GCS_PORT}"

    def network_commands(self) -> list[list[str]]:
        """Bridge, namespaces, veths, addresses, shaping: in order, each must succeed."""
        commands = [
            ["ip", "link", "add", self.bridge, "type", "bridge"],
            ["ip", "link", "set", self.bridge, "up"],
        ]
        for node in self.nodes:
            inner = f"{node.host_link}n"  # unique in the root namespace until it is moved
            commands += [
                ["ip", "netns", "add", node.netns],
                ["ip", "link", "add", node.host_link, "type", "veth", "peer", "name", inner],
                ["ip", "link", "set", inner, "netns", node.netns],
                ["ip", "-n", node.netns, "link", "set", inner, "name", NODE_LINK],
                ["ip", "-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", NODE_LINK],
                ["ip", "-n", node.netns, "link", "set", NODE_LINK, "up"],
                ["ip", "-n", node.netns, "link", "set", "lo", "up"],
                ["ip", "link", "set", node.host_link, "master", self.bridge],
                ["ip", "link", "set", node.host_link, "up"],
            ]
            rate = self.rate_of(node)
            if rate is not None:
                commands += shape_commands(NODE_LINK, rate, self.delay_ms, node.netns)
                commands += shape_commands(node.host_link, rate)  # node's ingress
        return commands

    def ray_start_command(self, node: NodeSpec, num_cpus: int, temp_dir: str) -> list[str]:
        """``ray start`` for ``node``, run inside its namespace: the head on node 0."""
        resources = json.dumps({node.resource: 1000})
        common = [
            f"--node-ip-address={node.ip}",
            f"--num-cpus={num_cpus}",
            f"--resources={resources}",
            "--disable-usage-stats",
        ]
        if self.metrics_port is not None:
            common.append(f"--metrics-export-port={self.metrics_port}")
        if node.index:
            return ["ray", "start", f"--address={self.address}", *common]
        dashboard = ["--include-dashboard=false"]
        if self.dashboard_port is not None:
            dashboard = [
                "--include-dashboard=true",
                f"--dashboard-host={node.ip}",
                f"--dashboard-port={self.dashboard_port}",
            ]
        return [
            "ray",
            "start",
            "--head",
            f"--port={GCS_PORT}",
            *dashboard,
            f"--temp-dir={temp_dir}",
            *common,
        ]

    def teardown_commands(self) -> list[list[str]]:
        """What deletes the network (the veths go with their namespaces); each may fail."""
        return [
            *(["ip", "netns", "del", n.netns] for n in self.nodes),
            *(["ip", "link", "del", n.host_link] for n in self.nodes),
            ["ip", "link", "del", self.bridge],
        ]


def plan_cluster(
    nodes: int,
    rate_bits: int | None,
    delay_ms: float = 0.0,
    tag: str | None = None,
    dashboard_port: int | None = None,
    metrics_port: int | None = None,
    node_rates: Sequence[int] = (),
) -> ClusterPlan:
    """Name every namespace, link and address of an ``nodes``-node cluster. ``tag`` (6 hex
    digits, random by default) keeps concurrent clusters apart and picks the subnet.
    ``node_rates``: each node's own rate instead of ``rate_bits`` (one per node)."""
    if node_rates and len(node_rates) != nodes:
        raise ValueError(f"node_rates names {len(node_rates)} rates for {nodes} nodes")
    if not 1 <= nodes <= MAX_NODES:
        raise ValueError(f"nodes must be 1..{MAX_NODES} (got {nodes}); pass --nodes 2 for two")
    if delay_ms < 0:
        raise ValueError(f"delay_ms must be >= 0 (got {delay_ms}); 0 adds no delay")
    if delay_ms and rate_bits is None:
        raise ValueError("delay_ms needs a rate: an unshaped link has no delay either")
    tag = tag or secrets.token_hex(3)
    if not re.fullmatch(r"[0-9a-f]{6}", tag):
        raise ValueError(f"tag must be 6 lowercase hex digits (got {tag!r})")
    subnet = f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    specs = tuple(
        NodeSpec(k, f"ws{tag}n{k}", f"{subnet}.{k + 1}", f"ws{tag}v{k}") for k in range(nodes)
    )
    return ClusterPlan(
        tag,
        specs,
        f"ws{tag}br",
        rate_bits,
        delay_ms,
        dashboard_port,
        metrics_port,
        tuple(node_rates),
    )


def check_usable() -> None:
    """Raise :class:`NetnsUnavailable` saying what is missing to build a shaped cluster here."""
    if sys.platform != "linux":
        raise NetnsUnavailable("the multi-node bench needs Linux network namespaces")
    if os.geteuid() != 0:
        raise NetnsUnavailable(
            "the multi-node bench builds network namespaces and shapes links with tc: run it as "
            "root (e.g. sudo -E weight-sync bench --nodes 2 ...)"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsUnavailable(
            f"the multi-node bench needs iproute2 ('ip') and 'tc'; missing: {', '.join(missing)} "
            "(apt-get install iproute2)"
        )
    probe = f"wsprobe{secrets.token_hex(3)}"
    made = subprocess.run(
        ["ip", "netns", "add", probe], capture_output=True, text=True, check=False
    )
    if made.returncode:
        raise NetnsUnavailable(f"cannot create a network namespace: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)


@dataclass
class ShapedCluster:
    """Context manager: the shaped network and (with ``ray``) a Ray node in every namespace.

    ``with ShapedCluster(2, parse_rate("1gbit")) as cluster: cluster.run(0, [...])``
    """

    nodes: int
    rate_bits: int | None  # None: links unshaped
    delay_ms: float = 0.0
    num_cpus: int = 1
    dashboard_port: int | None = None
    metrics_port: int | None = None
    node_rates: tuple[int, ...] = ()  # see plan_cluster
    ray: bool = True  # False: the network alone, for jobs launched without Ray
    plan: ClusterPlan = field(init=False)
    token: str = field(init=False)  # the cluster's own: never ~/.ray/auth_token

    def __post_init__(self) -> None:
        self.plan = plan_cluster(
            self.nodes,
            self.rate_bits,
            self.delay_ms,
            dashboard_port=self.dashboard_port,
            metrics_port=self.metrics_port,
            node_rates=self.node_rates,
        )
        self.token = secrets.token_hex(32)
        self._temp = ""
        self._restore_sigterm: Callable[[], None] | None = None  # while the cluster stands

    def env(self) -> dict[str, str]:
        """The environment of everything run inside the nodes: this interpreter's scripts first
        on PATH (``ray``), and the cluster's token (Ray 2.60 enforces token auth)."""
        bin_dir = str(Path(sys.executable).parent)
        return {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
        }

    def command(self, node: int, args: Sequence[str]) -> list[str]:
        """``args`` as run inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.plan.nodes[node].netns, *args]

    def run(
        self, node: int, args: Sequence[str], timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            self.command(node, args),
            env=self.env(),
            timeout=timeout,
            capture_output=True,
            text=True,
            check=False,
        )
        if check and done.returncode:
            raise RuntimeError(
                f"{' '.join(args)} failed in {self.plan.nodes[node].netns} "
                f"(exit {done.returncode}): {(done.stderr or done.stdout).strip()[-2000:]}"
            )
        return done

    def __enter__(self) -> Self:
        check_usable()
        self._restore_sigterm = _exit_on_sigterm()
        self._temp = tempfile.mkdtemp(prefix="ws_ray_")
        try:
            with _interrupts_deferred():
                for args in self.plan.network_commands():
                    _sh(args)
            for node in self.plan.nodes if self.ray else ():
                started = time.perf_counter()
                self.run(node.index, self.plan.ray_start_command(node, self.num_cpus, self._temp))
                logger.info("ray node %s up in %.1f s", node.netns, time.perf_counter() - started)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process of every namespace, delete namespaces and bridge. Idempotent, and
        KeyboardInterrupt waits until it is done (a half-deleted cluster leaks namespaces)."""
        with _interrupts_deferred():
            for node in self.plan.nodes:
                for _ in range(3):  # ray's daemons may fork while we kill
                    pids = _netns_pids(node.netns)
                    if not pids:
                        break
                    for pid in pids:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    time.sleep(0.2)
            for args in self.plan.teardown_commands():
                subprocess.run(args, capture_output=True, check=False)
            if self._temp:
                shutil.rmtree(self._temp, ignore_errors=True)
                self._temp = ""
        if self._restore_sigterm is not None:
            self._restore_sigterm()
            self._restore_sigterm = None


def _netns_pids(netns: str) -> list[int]:
    listed = subprocess.run(
        ["ip", "netns", "pids", netns], capture_output=True, text=True, check=False
    )
    return [int(pid) for pid in listed.stdout.split() if pid.isdigit()]


def _sh(args: Sequence[str]) -> None:
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode and "netem" in args:
        # Seen on a 6.18 kernel built without sch_netem: "Specified qdisc kind is unknown".
        raise NetnsUnavailable(
            f"this kernel cannot add a netem qdisc ({done.stderr.strip()}): --delay-ms needs "
            "sch_netem; load it (modprobe sch_netem) or pass --delay-ms 0"
        )
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} failed: {done.stderr.strip()}")


def _exit_on_sigterm() -> Callable[[], None]:
    """SIGTERM (``timeout``'s, a job runner's) raises ``SystemExit`` in the main thread while a
    cluster stands, so the ``with`` around it deletes the namespaces, bridge and processes --
    Python's default for SIGTERM ends the process at once, leaving them all behind. Returns
    what puts the handler before it back (nothing to put back outside the main thread, which
    takes no signals)."""

    def exit_(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        old = signal.signal(signal.SIGTERM, exit_)
    except ValueError:  # not the main thread
        return lambda: None

    def restore() -> None:
        signal.signal(signal.SIGTERM, _handler(old))

    return restore


class _interrupts_deferred:
    """Hold SIGINT and SIGTERM until the block is done: building or deleting a network half-way
    leaves namespaces behind. Only in the main thread (where Python handles signals)."""

    def __enter__(self) -> None:
        self._pending: list[int] = []
        self._old: dict[int, Any] = {}
        try:
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._old[signum] = signal.signal(signum, lambda n, f: self._pending.append(n))
        except ValueError:  # not the main thread
            pass

    def __exit__(self, *exc: object) -> None:
        for signum, old in self._old.items():
            signal.signal(signum, _handler(old))
        if signal.SIGTERM in self._pending:
            raise SystemExit(128 + signal.SIGTERM)
        if self._pending:
            raise KeyboardInterrupt


def _handler(old: Any) -> Any:
    """A handler ``signal.signal`` returned, as it can be set again (None: one set outside
    Python, which cannot be put back; the default then)."""
    return signal.SIG_DFL if old is None else old
