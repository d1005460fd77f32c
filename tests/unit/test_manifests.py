"""The deployment manifests parse, run our job with arguments it accepts, and reserve as many
GPUs as the job's layout needs."""

import shlex
from pathlib import Path

import pytest
import yaml

from weight_sync.tools.ray_job import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def job_args(entrypoint: str):
    words = shlex.split(entrypoint)
    assert words[:3] == ["python", "-m", "weight_sync.tools.ray_job"], entrypoint
    return build_parser().parse_args(words[3:])


def gpus_of(container: dict) -> int:
    return int(container["resources"]["limits"].get("nvidia.com/gpu", 0))


@pytest.mark.parametrize(
    ("name", "spread"), [("rayjob-one-node.yaml", False), ("rayjob-multi-node.yaml", True)]
)
def test_rayjob_manifests(name: str, spread: bool) -> None:
    manifest = yaml.safe_load((DEPLOY / "kuberay" / name).read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayJob"
    spec = manifest["spec"]
    args = job_args(spec["entrypoint"])
    assert args.spread == spread
    cluster = spec["rayClusterSpec"]
    pods = [(1, cluster["headGroupSpec"]["template"])]
    pods += [
        (group["replicas"], group["template"]) for group in cluster.get("workerGroupSpecs", [])
    ]
    gpus = sum(
        count * gpus_of(container) for count, pod in pods for container in pod["spec"]["containers"]
    )
    assert gpus == args.workers + 1  # one GPU per actor, none idle
    env = yaml.safe_load(spec["runtimeEnvYAML"])["env_vars"]
    if spread:  # across pods: the group must leave loopback, on the pods' interface
        assert args.interface == env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
    for _, pod in pods:
        assert pod["spec"]["containers"][0]["image"].endswith("weight-sync:0.1.0")


@pytest.mark.parametrize("name", ["one-node-8gpu.yaml", "multi-node.yaml"])
def test_cluster_launcher_configs(name: str) -> None:
    config = yaml.safe_load((DEPLOY / "cluster" / name).read_text())
    assert config["head_node_type"] in config["available_node_types"]
    starts = " ".join(
        config["head_start_ray_commands"] + config.get("worker_start_ray_commands", [])
    )
    assert "--metrics-export-port=8080" in starts
    assert any("weight_sync" in command for command in config["setup_commands"])


def test_runtime_env_is_plain_yaml() -> None:
    env = yaml.safe_load((DEPLOY / "runtime_env.yaml").read_text())
    assert set(env) == {"env_vars"} and all(isinstance(v, str) for v in env["env_vars"].values())
