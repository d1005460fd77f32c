"""Pushes into ``vllm serve`` over HTTP, from a trainer with neither Ray nor vLLM.

A server started with ``--weight-transfer-config '{"backend": "weight_sync"}'`` and
``VLLM_SERVER_DEV_MODE=1`` (which mounts vLLM's RL routes) is driven through the same push
protocol as every other member: one sender's lane (``lanes.ClientLanes`` over ``OneRank``; a
sharded trainer's ranks each push one, ``senders``), its workers following it from the
trainer's small store, over vLLM's own weight-transfer API -- one HTTP call per server per
step. Nothing here imports vLLM: the trainer side of an HTTP deployment needs only the standard
library's HTTP client::

    with VLLMServers(["http://10.0.0.2:8000", "http://10.0.0.3:8000"]) as servers:
        for step in range(steps):
            ...  # generate over /v1/completions, train
            result = servers.push(model.state_dict())   # every server now serves result.version

Here:

* ``ServersClient`` -- the five calls of vLLM's ``VLLMWeightSyncClient`` (init, start, update,
  finish, shutdown), each sent to every server at once: a call that waits on the workers of
  every server (their joining, the bytes) returns only once all of them are there, so the calls
  must run concurrently. A call that fails anywhere raises ``ServerError`` naming the
  server(s).
* the calls vLLM leaves to the caller of its client, made around each push -- pause, reset the
  prefix cache (its entries were computed with the old weights), label, resume -- and the
  release after a failure;
* ``VLLMServers`` -- the short API.

Versions: vLLM's OpenAI completions do not say which weights produced them. A caller learns it
from ``GET /weight_info`` (``versions()``; before and after its requests, or with no push in
between, since pushes pause the servers), or from vLLM's token-in-token-out endpoint
(``POST /inference/v1/generate``, mounted with ``--enable-scale-out``), whose outputs carry
``weight_versions`` spans.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from typing_extensions import Self

from weight_sync.adapters.vllm.lanes import ClientLanes
from weight_sync.config import SyncConfig
from weight_sync.control.http import call, check_urls, fan_out, unanswered
from weight_sync.errors import ServerError, WeightSyncError, first_line
from weight_sync.result import PushResult
from weight_sync.send.collectives import OneRank
from weight_sync.send.sharded import ShardedSource
from weight_sync.wire.mapping import Transform
from weight_sync.wire.state_dict import Rename, StateDict
from weight_sync.wire.versions import NO_VERSION, label_version

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = [
    "NO_VERSION",
    "ServerError",
    "ServersClient",
    "VLLMServers",
    "call",
    "release_server",
]

logger = logging.getLogger(__name__)

PauseMode = Literal["keep", "wait", "abort"]
_QUICK_S = 10.0  # bound on a small call (labels, resume) made after a failure
_RELEASE_S = 300.0  # bound on a worker's release calls, queued behind a worker call failing


class ServersClient:
    """vLLM's weight-transfer client calls (``VLLMWeightSyncClient``), each made to every server
    in ``urls`` at once and bounded by ``timeout_s``; any failure raises ``ServerError`` naming
    the failing server(s). ``init_weight_transfer_engine`` also tells each server its own URL
    (``server_url``), so that its workers can release it if this trainer dies mid-push.

    ``failures`` collects every server that failed a call, until the caller clears it."""

    def __init__(self, urls: Sequence[str], timeout_s: float) -> None:
        self.urls = list(urls)
        self.timeout_s = timeout_s
        self.failures: dict[str, str] = {}

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._each(
            "init_weight_transfer_engine",
            lambda url: {"init_info": {**init_info, "server_url": url}},
            settle=False,
        )

    def start_weight_update(self) -> None:
        self._each("start_weight_update", lambda url: None)

    def update_weights(
        self, update_info: dict[str, Any], lost: Callable[[str, str], None] | None = None
    ) -> None:
        """``lost(url, why)``: told at once of each server that stopped answering mid-call (its
        workers, which take the bytes in the call, are gone with it)."""
        body = {"update_info": update_info}
        self._each("update_weights", lambda url: body, settle=False, lost=lost)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = None if weight_version is None else {"weight_version": weight_version}
        self._each("finish_weight_update", lambda url: body)

    def shutdown_weight_transfer_engine(self) -> None:
        self._each("shutdown_weight_transfer_engine", lambda url: None)

    def _each(
        self,
        path: str,
        body: Callable[[str], Mapping[str, Any] | None],
        settle: bool = True,
        lost: Callable[[str, str], None] | None = None,
    ) -> None:
        """``settle`` (see ``fan_out``): the steps each server takes alone (opening, closing a
        session; leaving the group) -- a late one would land after the release that follows,
        a session opened then, or a version set over its "none". Not the steps that wait on the
        group (forming it, the bytes). ``lost``: as ``update_weights``'."""

        def step(url: str) -> Any:
            try:
                return call(url, path, body(url), timeout_s=self.timeout_s, method="POST")
            except ServerError as exc:
                if lost is not None and unanswered(exc):
                    lost(url, exc.servers.get(url, first_line(exc)))
                raise

        try:
            fan_out(self.urls, step, self.timeout_s + 1.0, path, settle=settle)
        except ServerError as exc:
            self.failures.update(exc.servers)
            raise


def release_server(
    url: str, *, holds_version: bool, session_open: bool, timeout_s: float = _RELEASE_S
) -> None:
    """What a server's worker does when the trainer that paused its server died: label the
    outputs ``"none"`` unless the worker holds a committed version, end the update session the
    trainer left open (``session_open``: vLLM refuses every later trainer until then, and
    raises at the end of a session that is not), and resume generation if paused.
    Fire-and-forget on a thread of its own: the call runs inside a worker process whose engine
    may be busy (a worker call still running), and must never wait on it; the calls are queued
    behind that call, hence the long bound."""

    def release() -> None:
        try:
            if not holds_version:
                call(url, "update_weight_version", {"new_version": NO_VERSION}, timeout_s=timeout_s)
            if session_open:
                call(url, "finish_weight_update", None, timeout_s=timeout_s, method="POST")
            if (call(url, "is_paused", timeout_s=timeout_s) or {}).get("is_paused"):
                call(url, "resume", timeout_s=timeout_s)
            logger.warning(
                "the trainer died: released server %s (holds a version: %s)", url, holds_version
            )
        except Exception as exc:
            logger.warning("the trainer died, and releasing server %s failed: %s", url, exc)

    threading.Thread(target=release, name="weight-sync-release", daemon=True).start()


def pause(urls: Sequence[str], mode: PauseMode, timeout_s: float) -> None:
    """Pause generation on every server (``mode``: what happens to requests in flight)."""
    fan_out(
        urls,
        lambda url: call(url, f"pause?mode={mode}", timeout_s=timeout_s),
        timeout_s + 1.0,
        "pause",
    )


def labels(urls: Sequence[str], timeout_s: float) -> dict[str, str]:
    """Each server's weight version label (``GET /weight_info``), by URL."""
    answers = fan_out(
        urls,
        lambda url: call(url, "weight_info", timeout_s=timeout_s),
        timeout_s + 1.0,
        "weight_info",
    )
    return {url: str((answer or {}).get("weight_version")) for url, answer in answers.items()}


def count_workers(urls: Sequence[str], timeout_s: float) -> int:
    """The worker processes of every server together (``GET /get_world_size``): the members
    of a push, a server with tensor parallelism 2 being two."""
    sizes = fan_out(
        urls,
        lambda url: call(url, "get_world_size?include_dp=true", timeout_s=timeout_s),
        timeout_s + 1.0,
        "get_world_size",
    )
    workers = sum(int((sizes[url] or {}).get("world_size", 0)) for url in urls)
    if workers < len(urls):
        raise WeightSyncError(f"the servers report {workers} workers in all: {sizes}")
    return workers


def reset_caches(urls: Sequence[str], timeout_s: float) -> None:
    """The prefix cache's entries were computed with the old weights: a prompt sharing a
    cached prefix would be answered partly by them. A server that cannot reset claims no
    version (``ServerError``)."""
    answers = fan_out(
        urls,
        lambda url: call(
            url, "reset_prefix_cache?reset_running_requests=true", timeout_s=timeout_s
        ),
        timeout_s + 1.0,
        "reset_prefix_cache",
    )
    failed = {
        url: "reset_prefix_cache answered success=false"
        for url, answer in answers.items()
        if not (answer or {}).get("success")
    }
    if failed:
        raise ServerError(f"the prefix cache could not be reset on {sorted(failed)}", failed)


def resume(urls: Sequence[str], *, quiet: bool) -> None:
    """Resume generation everywhere; ``quiet``: after a failed push, only log a failure (every
    call finishes first, as ``fan_out`` settles: a late resume could let a server generate
    while the next push changes its weights)."""
    try:
        fan_out(
            urls,
            lambda url: call(url, "resume", timeout_s=_QUICK_S),
            _QUICK_S + 1.0,
            "resume",
        )
    except ServerError as exc:
        if not quiet:
            raise
        logger.warning("resuming after a failed push: %s", exc)


def release(urls: Sequence[str], error: BaseException) -> dict[str, str]:
    """After a failed push: every server still reachable claims no version and serves again
    (best effort, bounded; the error raised is the push's). Returns the servers that could
    not be reached, with why."""
    unreachable: dict[str, str] = {}
    for url in urls:
        try:
            call(url, "update_weight_version", {"new_version": NO_VERSION}, timeout_s=_QUICK_S)
            call(url, "resume", timeout_s=_QUICK_S)
        except ServerError as exc:
            unreachable[url] = exc.servers.get(url, str(exc))
            logger.warning("after a failed push (%s), server %s: %s", error, url, exc)
    return unreachable


class ServersAround:
    """What rank 0 does around each push into ``vllm serve`` processes at ``urls``
    (``lanes.Around``): the calls vLLM leaves to the caller of its client."""

    def __init__(self, urls: Sequence[str], pause_mode: PauseMode) -> None:
        self.names = list(urls)
        self.pause_mode = pause_mode

    def count(self, timeout_s: float) -> int:
        return count_workers(self.names, timeout_s)

    def relabelled(self, committed: int, timeout_s: float) -> bool:
        """Whether a server does not report version ``committed`` (or did not answer)."""
        try:
            held = labels(self.names, timeout_s)
        except ServerError as exc:
            logger.warning("asking the servers' versions: %s", exc)
            return True
        moved = {url: label for url, label in held.items() if label != str(committed)}
        if moved:
            logger.warning(
                "server(s) %s do not hold version %d (restarted?): every worker joins anew",
                moved,
                committed,
            )
        return bool(moved)

    def pause(self, timeout_s: float) -> None:
        pause(self.names, self.pause_mode, timeout_s)

    def loaded(self, timeout_s: float) -> None:
        reset_caches(self.names, timeout_s)

    def resume(self, quiet: bool) -> None:
        resume(self.names, quiet=quiet)

    def release(self, error: BaseException) -> dict[str, str]:
        return release(self.names, error)


class VLLMServers:
    """Pushes a trainer's weights into running ``vllm serve`` processes (see the module doc).

    ``urls``: each server's base URL. ``config``: how pushes run; its ``push_timeout_s`` bounds
    the push itself, and the calls around it (pause, cache reset, resume) are each bounded by
    ``rpc_timeout_s``. ``pause_mode``: what pausing does to requests in flight -- ``"keep"``
    freezes them (recomputed with the new weights on resume), ``"wait"`` lets them finish with
    the old weights first, ``"abort"`` ends them. ``senders``: the trainers' torch.distributed
    group (``dist.group.WORLD``, or a subgroup), every rank of which makes ``VLLMServers`` over
    the same URLs at once and pushes its own shards at the same point (docs/many-senders.md);
    rank 0 makes every HTTP call. None: this process pushes alone -- the same protocol, one
    sender (``lanes.ClientLanes`` either way).

    Every worker of every server (a server with tensor parallelism 2 is two, counted by
    ``GET /get_world_size``) joins as the first push begins -- making this touches no server --
    and again after a push that failed other than by a refusal, and whenever a server reports a
    version other than the last one pushed (it restarted, or its worker released it after a
    trainer died): a restarted server at the same URL rejoins with full weights at the next
    push.
    """

    def __init__(
        self,
        urls: Sequence[str],
        config: SyncConfig | None = None,
        *,
        pause_mode: PauseMode = "keep",
        senders: dist.ProcessGroup | OneRank | None = None,
    ) -> None:
        self.urls = check_urls(urls, "vLLM")
        if config is not None and not isinstance(config, SyncConfig):
            raise TypeError(f"config must be a SyncConfig, got {type(config).__name__}")
        if pause_mode not in ("keep", "wait", "abort"):
            raise ValueError(f"pause_mode must be 'keep', 'wait' or 'abort', got {pause_mode!r}")
        group = senders if senders is not None else OneRank()
        client = ServersClient(self.urls, (config or SyncConfig()).push_timeout_s)
        around = ServersAround(self.urls, pause_mode)
        self._lanes = ClientLanes(client, around, config, group, "VLLMServers")
        self.config = self._lanes.config
        self.pause_mode = pause_mode
        self._lock = threading.Lock()

    @property
    def version(self) -> int | None:
        """The last version committed on every server by this object (None before the first)."""
        return self._lanes.version or None

    def versions(self) -> list[int | None]:
        """Each server's committed version as it reports it (``GET /weight_info``): None where
        it holds none (no push yet, or a push failed part-way). Raises ``ServerError`` naming the
        servers that did not answer."""
        held = labels(self.urls, self.config.rpc_timeout_s)
        return [label_version(held[url]) for url in self.urls]

    def push(
        self,
        state_dict: StateDict | ShardedSource,
        *,
        rename: Rename | None = None,
        transform: Transform | None = None,
        version: int | None = None,
    ) -> PushResult:
        """Push every tensor of ``state_dict`` (or a ``ShardedSource``, gathered with the other
        trainer ranks) to every server, as ``WeightUpdater.push``; when it returns, every server
        serves ``result.version``, its prefix cache reset, and is resumed. ``version``: as
        ``WeightUpdater.push`` (past every version a server's workers were ever sent, or
        refused).

        Raises ``TypeError``/``ValueError`` for a bad state dict and ``PlanMismatchError`` when
        the servers refused it, both before any byte moved (the servers keep their weights and
        versions, and are resumed);
        otherwise a ``WeightSyncError`` -- ``ServerError`` naming the servers that failed where
        that is known -- after which the servers still reachable report no version and serve
        again, until a push repairs them.

        With ``senders``: this rank's shards of the state dict while every other rank pushes
        its own (``transform`` and a ``ShardedSource`` are one sender's), each error raised on
        every rank; ``SenderFailedError`` names the trainer ranks whose lanes did not land."""
        options = {"rename": rename, "transform": transform, "version": version}
        with self._lock:  # pushes from several threads, one after the other
            return self._lanes.push(state_dict, options)

    def close(self) -> None:
        """Leave: every reachable server's workers stop following this trainer (they keep
        serving their weights), and the trainer's control store stops. Idempotent."""
        with self._lock:
            self._lanes.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
