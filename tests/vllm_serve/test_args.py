"""What needs no server: the trainer side imports without vLLM, bad arguments are refused at
construction with a message that says what to change, and an address where nothing listens
fails fast with the server named."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch

from weight_sync import SyncConfig
from weight_sync.adapters.vllm import ServerProcess, VLLMServers
from weight_sync.adapters.vllm.servers import ServerError


def test_the_trainer_side_imports_without_vllm() -> None:
    script = (
        "import sys; sys.modules['vllm'] = None\n"  # any `import vllm` now fails
        "from weight_sync.adapters.vllm import ServerProcess, VLLMServers\n"
        "VLLMServers(['http://127.0.0.1:8000']).close()\n"
        "assert not any(name == 'vllm' or name.startswith('vllm.') for name in sys.modules\n"
        "               if sys.modules[name] is not None)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


@pytest.mark.parametrize(
    ("urls", "error", "match"),
    [
        ([], ValueError, "urls is empty"),
        (["127.0.0.1:8000"], ValueError, "not an http"),
        (["ftp://127.0.0.1:8000"], ValueError, "not an http"),
        (["http://127.0.0.1:8000/v1"], ValueError, "no path"),
        (["http://a:1", "http://A:1/"], ValueError, "duplicate"),
        ("http://127.0.0.1:8000", TypeError, "list of base URLs"),
        ([8000], TypeError, "must be a str"),
    ],
)
def test_bad_urls_are_refused(urls: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        VLLMServers(urls)  # type: ignore[arg-type]


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="pause_mode"):
        VLLMServers(["http://127.0.0.1:8000"], pause_mode="later")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SyncConfig"):
        VLLMServers(["http://127.0.0.1:8000"], {"push_timeout_s": 60})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="port"):
        ServerProcess("model", port=70000)
    with pytest.raises(ValueError, match="not in args"):
        ServerProcess("model", args=["--port", "8000"])


def test_a_server_nobody_runs_fails_fast_and_by_name() -> None:
    with socket.socket() as probe:  # a port nothing listens on (bound, never listening)
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
        with VLLMServers([url], SyncConfig(push_timeout_s=30)) as servers:
            began = time.monotonic()
            with pytest.raises(ServerError) as caught:
                servers.push({"w": torch.zeros(4)})
            assert list(caught.value.servers) == [url]
            with pytest.raises(ServerError, match="weight_info"):
                servers.versions()
            assert time.monotonic() - began < 10
