"""What needs no SGLang: the trainer side imports without SGLang or Ray, bad arguments are
refused at construction with a message that says what to change, and an address where nothing
listens fails fast with the server named."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
import torch

from weight_sync import SyncConfig
from weight_sync.adapters.sglang import ServerError, SGLangServer, SGLangServers


def test_the_trainer_side_imports_without_sglang_or_ray() -> None:
    script = (
        "import sys; sys.modules['sglang'] = None; sys.modules['ray'] = None\n"
        "from weight_sync.adapters.sglang import SGLangServers, release_servers\n"
        "SGLangServers(['http://127.0.0.1:30000']).close()\n"
        "assert not any(name.split('.')[0] in ('sglang', 'ray') for name in sys.modules\n"
        "               if sys.modules[name] is not None)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: SGLangServers([]), ValueError, "urls is empty"),
        (lambda: SGLangServers(["http://127.0.0.1:1"], pause_mode="in_place"), ValueError,
         "refuses the flush"),
        (lambda: SGLangServers(["http://127.0.0.1:1"], SyncConfig(delta=True)), ValueError,
         "delta=False"),
        (lambda: SGLangServers(["http://127.0.0.1:1"], {"bucket_bytes": 1}), TypeError,
         "SyncConfig"),
        (lambda: SGLangServers(["http://10.1.2.3:30000"]), ValueError, "master_addr"),
        (lambda: SGLangServer("model", args=["--port", "1"]), ValueError, "not in args"),
        (lambda: SGLangServer("model", port=70000), ValueError, "port"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_with_what_to_change(
    make: object, error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        make()  # type: ignore[operator]


def test_servers_on_other_hosts_take_the_trainers_address() -> None:
    SGLangServers(["http://10.1.2.3:30000"], SyncConfig(master_addr="10.1.2.4")).close()


def test_a_server_nobody_runs_fails_fast_and_by_name() -> None:
    with socket.socket() as probe:  # a port nothing listens on (bound, never listening)
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
        with SGLangServers([url], SyncConfig(push_timeout_s=30)) as servers:
            began = time.monotonic()
            with pytest.raises(ServerError) as caught:
                servers.push({"w": torch.zeros(4)})
            assert list(caught.value.servers) == [url]
            with pytest.raises(ServerError, match="model_info"):
                servers.versions()
            assert time.monotonic() - began < 10
