"""Pushes into SGLang HTTP servers (``python -m sglang.launch_server``), from a trainer with
neither Ray nor SGLang: the standard library's HTTP client and torch's Gloo or NCCL group.

    with SGLangServers(["http://10.0.0.2:30000", "http://10.0.0.3:30000"]) as servers:
        for step in range(steps):
            ...  # generate over /generate, train
            result = servers.push(model.state_dict())  # every server now serves result.version

Every server's outputs say which push produced them: ``meta_info["weight_version"]`` of
``/generate``, the version as a string (``"none"`` while a push is under way or after one
failed part-way). The push checks names and shapes against the checkpoint the servers were
started from, read where the trainer can see it (``/model_info``'s ``model_path``, or
``checkpoint=``); see ``pusher`` for everything else.

What SGLang does not let us keep over HTTP: a trainer killed mid-push leaves the servers paused,
labelled ``"none"`` and inside an update session -- SGLang has no hook to notice that the trainer
went away, and there is no code of ours in the server. ``release_servers`` undoes it (any
later push from a new trainer does too); until then the servers accept requests but do not run
them.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from weight_sync.adapters.sglang.client import HTTPEngine
from weight_sync.adapters.sglang.pusher import PauseMode, SGLangPusher, release
from weight_sync.config import SyncConfig
from weight_sync.control.http import check_urls, fan_out
from weight_sync.wire.versions import label_past

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["SGLangServers", "release_servers"]


def _loopback(host: str | None) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host or "").is_loopback
    except ValueError:
        return False  # a host name: not known to be this host


class SGLangServers(SGLangPusher):
    """Pushes a trainer's weights into running SGLang servers at ``urls`` (see the module doc
    and ``SGLangPusher``). ``checkpoint``: a folder holding the checkpoint the servers were
    started from, where the trainer cannot read their ``model_path`` itself."""

    def __init__(
        self,
        urls: Sequence[str],
        config: SyncConfig | None = None,
        *,
        pause_mode: PauseMode = "retract",
        checkpoint: str | Path | None = None,
        senders: dist.ProcessGroup | None = None,
    ) -> None:
        self.urls = check_urls(urls, "SGLang")
        config = config or SyncConfig()
        remote = [url for url in self.urls if not _loopback(urllib.parse.urlsplit(url).hostname)]
        if remote and config.interface is None and _loopback(config.master_addr):
            raise ValueError(
                f"the servers {remote} are on other hosts, but the trainer would listen on "
                f"{config.master_addr} (loopback): set SyncConfig(master_addr=) to an address of "
                "this host they reach, or interface="
            )
        super().__init__(
            [HTTPEngine(url, checkpoint) for url in self.urls],
            config,
            pause_mode=pause_mode,
            senders=senders,
        )


def release_servers(urls: Sequence[str], timeout_s: float = 30.0) -> None:
    """Free SGLang servers a dead trainer left mid-push: end its update session, label them
    ``"none (past N)"`` (the weights may be half-new: the next push repairs them; ``N`` the
    highest version their label shows they were pushed) and resume generation
    (``pusher.release``). ``ServerError`` names the servers that failed."""
    engines = {url: HTTPEngine(url) for url in check_urls(urls, "SGLang")}

    def free(url: str) -> None:
        info = engines[url].call("model_info", None, timeout_s) or {}
        label = str(info.get("weight_version"))
        release(engines[url], None, past=label_past(label), resume=True, timeout_s=timeout_s)

    fan_out(list(engines), free, timeout_s * 4 + 1.0, "release")
