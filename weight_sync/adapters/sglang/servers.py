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

import logging
from collections.abc import Sequence
from pathlib import Path

from weight_sync.adapters.sglang.client import HTTPEngine
from weight_sync.adapters.sglang.pusher import NO_VERSION, PauseMode, SGLangPusher
from weight_sync.config import SyncConfig
from weight_sync.http import ServerError, call, check_urls, fan_out

__all__ = ["SGLangServers", "release_servers"]

logger = logging.getLogger(__name__)


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
    ) -> None:
        self.urls = check_urls(urls, "SGLang")
        super().__init__([HTTPEngine(url, checkpoint) for url in self.urls], config,
                         pause_mode=pause_mode)  # fmt: skip


def release_servers(urls: Sequence[str], timeout_s: float = 30.0) -> None:
    """Free SGLang servers a dead trainer left mid-push: end its update session (an error when
    none is open is expected), label them ``"none"`` (the weights may be half-new: the next push
    repairs them) and resume generation. ``ServerError`` names the servers that failed."""

    def release(url: str) -> None:
        try:
            call(url, "end_weight_update", {}, timeout_s=timeout_s)
        except ServerError as exc:  # no session open: nothing to end
            logger.debug("release %s: %s", url, exc)
        call(url, "update_weight_version", {"new_version": NO_VERSION, "abort_all_requests": False},
             timeout_s=timeout_s)  # fmt: skip
        call(url, "continue_generation", {"torch_empty_cache": False}, timeout_s=timeout_s)

    fan_out(check_urls(urls, "SGLang"), release, timeout_s * 3 + 1.0, "release")
