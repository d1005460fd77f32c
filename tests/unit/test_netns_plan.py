"""The shaped cluster's pure pieces: rates, token buckets, tc/ip command lines, names, layouts.
Nothing here needs root or a namespace (tests/deploy/test_shaped_links.py builds one)."""

from __future__ import annotations

import json

import pytest
import torch

from weight_sync.tools.bench.links import Layout, workload_named
from weight_sync.tools.bench.netns import (
    MIN_BURST,
    burst_bytes,
    format_rate,
    netem_limit,
    parse_rate,
    plan_cluster,
    shape_commands,
)
from weight_sync.tools.bench.report import LinkRow, links_markdown


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("100mbit", 100_000_000),
        ("1gbit", 1_000_000_000),
        ("10gbit", 10_000_000_000),
        ("2.5gbit", 2_500_000_000),
        ("500kbit", 500_000),
        ("125mbps", 1_000_000_000),  # tc: bps are bytes
        (" 1GBIT ", 1_000_000_000),
    ],
)
def test_parse_rate(text: str, bits: int) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["1000", "1gbt", "gbit", "-1gbit", "50kbit", ""])
def test_parse_rate_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="rate"):
        parse_rate(text)


@pytest.mark.parametrize(
    ("bits", "text"),
    [(10**8, "100mbit"), (10**9, "1gbit"), (10**10, "10gbit"), (2_500_000_000, "2500mbit"),
     (1234, "1234bit")],
)  # fmt: skip
def test_format_rate(bits: int, text: str) -> None:
    assert format_rate(bits) == text


@pytest.mark.parametrize(
    ("bits", "burst"),
    [(10**8, MIN_BURST), (10**9, 500_000), (10**10, 5_000_000), (10**6, MIN_BURST)],
)
def test_burst_is_4ms_of_traffic_at_least_64k(bits: int, burst: int) -> None:
    assert burst_bytes(bits) == burst


@pytest.mark.parametrize(
    ("bits", "delay", "limit"),
    [(10**8, 1.0, 1000), (10**9, 10.0, 1667), (10**10, 5.0, 8334)],
)
def test_netem_queue_holds_twice_what_is_in_flight(bits: int, delay: float, limit: int) -> None:
    assert netem_limit(bits, delay) == limit


@pytest.mark.parametrize(
    ("device", "bits", "delay", "netns", "expected"),
    [
        ("eth0", 10**9, 0.0, None,
         [["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "1000000000bit",
           "burst", "500000", "latency", "50ms"]]),
        ("eth0", 10**8, 0.0, "ns1",
         [["ip", "netns", "exec", "ns1", "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
           "rate", "100000000bit", "burst", "65536", "latency", "50ms"]]),
        ("v0", 10**9, 2.5, "ns0",
         [["ip", "netns", "exec", "ns0", "tc", "qdisc", "add", "dev", "v0", "root", "handle",
           "1:", "netem", "delay", "2.5ms", "limit", "1000"],
          ["ip", "netns", "exec", "ns0", "tc", "qdisc", "add", "dev", "v0", "parent", "1:",
           "handle", "2:", "tbf", "rate", "1000000000bit", "burst", "500000", "latency",
           "50ms"]]),
    ],
)  # fmt: skip
def test_shape_commands(
    device: str, bits: int, delay: float, netns: str | None, expected: list[list[str]]
) -> None:
    assert shape_commands(device, bits, delay, netns) == expected


def test_shape_refuses_a_negative_delay() -> None:
    with pytest.raises(ValueError, match="delay_ms must be >= 0"):
        shape_commands("eth0", 10**9, -1)


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_plan_names_every_node_and_shapes_both_ends(nodes: int) -> None:
    plan = plan_cluster(nodes, 10**9, tag="0a1b2c")
    assert [n.ip for n in plan.nodes] == [f"10.210.27.{k + 1}" for k in range(nodes)]
    assert [n.netns for n in plan.nodes] == [f"ws0a1b2cn{k}" for k in range(nodes)]
    assert plan.address == "10.210.27.1:6379" and plan.bridge == "ws0a1b2cbr"
    assert all(len(n.host_link + "n") <= 15 for n in plan.nodes)  # IFNAMSIZ
    commands = plan.network_commands()
    assert commands[:2] == [["ip", "link", "add", "ws0a1b2cbr", "type", "bridge"],
                            ["ip", "link", "set", "ws0a1b2cbr", "up"]]  # fmt: skip
    shaped = [c for c in commands if "tbf" in c]
    assert len(shaped) == 2 * nodes  # node egress (inside) and node ingress (the root end)
    for node in plan.nodes:
        assert ["ip", "link", "set", node.host_link, "master", plan.bridge] in commands
        assert ["ip", "-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", "eth0"] in commands
        assert any(c[:4] == ["ip", "netns", "exec", node.netns] and "eth0" in c for c in shaped)
        assert any(c[:5] == ["tc", "qdisc", "add", "dev", node.host_link] for c in shaped)
    teardown = plan.teardown_commands()
    assert ["ip", "netns", "del", plan.nodes[-1].netns] in teardown
    assert teardown[-1] == ["ip", "link", "del", plan.bridge]


def test_delay_is_on_the_node_egress_only() -> None:
    commands = plan_cluster(2, 10**9, delay_ms=5, tag="00aa00").network_commands()
    netem = [c for c in commands if "netem" in c]
    assert len(netem) == 2 and all(c[:3] == ["ip", "netns", "exec"] for c in netem)


def test_ray_start_commands_pin_nodes_by_resource() -> None:
    plan = plan_cluster(2, 10**9, tag="00aa00")
    head = plan.ray_start_command(plan.nodes[0], 1, "/tmp/x")
    other = plan.ray_start_command(plan.nodes[1], 1, "/tmp/x")
    assert head[:3] == ["ray", "start", "--head"] and "--temp-dir=/tmp/x" in head
    assert f"--address={plan.address}" in other and "--head" not in other
    for node, command in zip(plan.nodes, (head, other), strict=True):
        assert f"--node-ip-address={node.ip}" in command
        resources = next(a for a in command if a.startswith("--resources="))
        assert json.loads(resources.split("=", 1)[1]) == {f"ws_node_{node.index}": 1000}


def test_an_unshaped_cluster_with_a_dashboard_and_metrics() -> None:
    """The deploy test's cluster: links as fast as the machine, the head's dashboard on its
    address (job submission), every node's metrics exported."""
    plan = plan_cluster(2, None, tag="00aa00", dashboard_port=8265, metrics_port=8080)
    assert not any("tc" in command for command in plan.network_commands())
    head = plan.ray_start_command(plan.nodes[0], 1, "/tmp/x")
    other = plan.ray_start_command(plan.nodes[1], 1, "/tmp/x")
    assert "--include-dashboard=true" in head and f"--dashboard-host={plan.head.ip}" in head
    assert "--dashboard-port=8265" in head and not any("dashboard" in a for a in other)
    assert all("--metrics-export-port=8080" in command for command in (head, other))
    shaped = plan_cluster(2, 10**9, tag="00aa00").ray_start_command(plan.nodes[0], 1, "/tmp/x")
    assert "--include-dashboard=false" in shaped and not any("metrics" in a for a in shaped)


def test_a_node_of_its_own_rate_is_shaped_at_it_both_ways() -> None:
    """The many-senders bench's node of workers, wider than each trainer node's link."""
    plan = plan_cluster(3, None, tag="00aa00", node_rates=(10**9, 10**9, 2 * 10**9))
    rates = [
        (c[c.index("dev") + 1], c[c.index("rate") + 1]) for c in plan.network_commands() if "tbf" in c
    ]
    expected = []
    for k, rate in enumerate(("1000000000bit", "1000000000bit", "2000000000bit")):
        expected += [("eth0", rate), (f"ws00aa00v{k}", rate)]  # its egress, then its ingress
    assert rates == expected


@pytest.mark.parametrize(
    ("nodes", "rate", "kwargs", "error"),
    [(0, 10**9, {}, "nodes must be 1..8"), (9, 10**9, {}, "nodes must be 1..8"),
     (2, 10**9, {"delay_ms": -1}, "delay_ms"), (2, 10**9, {"tag": "XYZ"}, "tag must be"),
     (2, None, {"delay_ms": 5}, "delay_ms needs a rate"),
     (3, 10**9, {"node_rates": (10**9,) * 2}, "2 rates for 3 nodes")],
)  # fmt: skip
def test_plan_refuses(nodes: int, rate: int | None, kwargs: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        plan_cluster(nodes, rate, **kwargs)


@pytest.mark.parametrize(
    ("layout", "per_node"),
    [
        (Layout(2, 3), [0, 3]),
        (Layout(4, 2), [0, 2, 2, 2]),
        (Layout(3, 1, local_workers=True), [1, 1, 1]),
        (Layout(1, 3), [3]),  # one node: the workers are the trainer's neighbours
    ],
)
def test_layout(layout: Layout, per_node: list[int]) -> None:
    assert layout.per_node() == per_node and layout.workers == sum(per_node)


def test_workloads_and_payload() -> None:
    assert workload_named("S16M").nbytes == 16 << 20
    assert workload_named("S16M").nbytes_as(torch.bfloat16) == 8 << 20  # fp32 cast to bf16
    assert workload_named("W1").nbytes_as(None) == workload_named("W1").nbytes
    with pytest.raises(ValueError, match="S<MB>M"):
        workload_named("W9")


def test_links_report_counts_crossings() -> None:
    common = {"suite": "links", "workload": "S8M", "title": "8 MB synthetic",
              "rate_bits": 10**8, "delay_ms": 0.0, "nodes": 2, "workers_per_node": 3,
              "local_workers": False, "workers": 3, "payload_bytes": 4_000_000}  # fmt: skip
    rows = [
        LinkRow(mode="dense", seconds=[0.4, 0.3, 0.5], wire_bytes=[4_000_000] * 3,
                sent_bytes=[4_100_000] * 3, verified=True, **common),  # type: ignore[arg-type]
        LinkRow(mode="raw", seconds=[0.8], wire_bytes=[4_000_000], sent_bytes=[8_200_000],
                **common),  # type: ignore[arg-type]
    ]  # fmt: skip
    assert rows[0].crossings == pytest.approx(1.025) and rows[1].crossings == pytest.approx(2.05)
    assert rows[0].bound == pytest.approx(0.32)
    text = links_markdown(rows)
    assert (
        "| 100mbit | dense | 0.400 | 0.300 | 0.500 | 4.00 | 1.02 | 0.320 | 1.25 | 0.50 | 0/3 | yes |"
        in text
    )


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"nodes": None, "rates": [10**9]}, "pass --nodes"),
        ({"nodes": 2, "rates": []}, "rates is empty"),
        ({"nodes": 2, "rates": [10**9], "workloads": ["W9"]}, "unknown workload"),
        ({"nodes": 2, "rates": [10**9], "repeats": 0}, "repeats must be"),
    ],
)
def test_run_links_refuses_bad_arguments_before_building_anything(kwargs: dict, error: str) -> None:
    from weight_sync.tools.bench.links import run_links

    with pytest.raises(ValueError, match=error):
        run_links(**kwargs)


def test_pool_makes_each_node_only_the_workers_some_layout_needs() -> None:
    from weight_sync.tools.bench.links import Pool

    pool = Pool.of([Layout(2, 3)])
    assert pool.sizes == (0, 3) and pool.members(Layout(2, 3)) == [0, 1, 2]
    layouts = [Layout(n, k, local_workers=True) for k in (1, 2, 3) for n in (1, 2, 3, 4)]
    pool = Pool.of(layouts)
    assert pool.sizes == (3, 3, 3, 3)
    assert pool.members(Layout(2, 2, local_workers=True)) == [0, 1, 3, 4]
    assert pool.members(Layout(1, 3)) == [0, 1, 2]


def test_not_root_is_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from weight_sync.tools.bench.netns import NetnsUnavailable, check_usable

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NetnsUnavailable, match="run it as root"):
        check_usable()
