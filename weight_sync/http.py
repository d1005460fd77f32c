"""Inference servers over HTTP, with the standard library only: one call, the same call to many
servers at once, and the error that names the servers that failed.

Shared by the adapters that drive servers without Ray (``vllm serve``, SGLang's
``launch_server``). Answers are small JSON, read up to ``MAX_BODY`` bytes; nothing is
unpickled. Proxies from the environment are bypassed: they would route loopback and
cluster-internal addresses through a proxy that cannot reach them.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, wait
from functools import partial
from typing import Any

from weight_sync.control import in_thread
from weight_sync.errors import WorkerFailedError

__all__ = ["MAX_BODY", "ServerError", "call", "check_urls", "fan_out"]

MAX_BODY = 1 << 20  # the largest answer read from a server (the routes we call answer tiny JSON)
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# Routes called without a body that are reads (``GET``); any other call without one is a POST.
_GETS = frozenset(
    {"weight_info", "get_world_size", "is_paused", "health", "model_info", "server_info"}
)


class ServerError(WorkerFailedError):
    """One or more inference servers failed: refused the connection, answered with an HTTP
    error, timed out, or reported a failure. ``servers`` maps each server's base URL (or an
    engine's name) to the reason.

    A ``WorkerFailedError``, so a loop that handles failed workers handles failed servers too;
    ``workers`` lists the sync-group members blamed, when a push got that far."""

    def __init__(
        self,
        message: str,
        servers: Mapping[str, str],
        workers: Sequence[int] = (),
        dropped: Sequence[int] = (),
    ) -> None:
        self.servers = dict(servers)
        super().__init__(message, workers, dropped)

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.servers, self.workers, self.dropped)


def call(
    url: str, path: str, body: Mapping[str, Any] | None = None, *, timeout_s: float,
    method: str | None = None, text: bool = False,
) -> Any:  # fmt: skip
    """One HTTP call to a server: ``POST`` with a JSON body (``GET`` when ``method`` says so, or
    with no body and a path under ``_GETS``); returns the decoded JSON answer (None if empty),
    or with ``text`` the answer as text. Raises ``ServerError`` for anything that is not a 2xx
    answer within ``timeout_s``."""
    data = None if body is None else json.dumps(body).encode()
    verb = method or ("GET" if body is None and path.split("?")[0] in _GETS else "POST")
    request = urllib.request.Request(
        f"{url}/{path}", data=data, method=verb, headers={"Content-Type": "application/json"}
    )
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            raw = response.read(MAX_BODY)
    except urllib.error.HTTPError as exc:
        detail = exc.read(500).decode(errors="replace").strip().replace("\n", " ")
        raise _failed(url, f"{verb} /{path}: HTTP {exc.code} {detail}") from exc
    except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
        reason = getattr(exc, "reason", exc)
        raise _failed(url, f"{verb} /{path}: {type(reason).__name__}: {reason}") from exc
    if text:
        return raw.decode(errors="replace")
    try:
        return json.loads(raw) if raw.strip() else None
    except ValueError as exc:
        raise _failed(url, f"{verb} /{path}: not JSON: {raw[:200]!r}") from exc


def _failed(url: str, reason: str) -> ServerError:
    return ServerError(f"server {url} failed: {reason}", {url: reason})


def fan_out(
    urls: Sequence[str], step: Callable[[str], Any], timeout_s: float, what: str
) -> dict[str, Any]:
    """``step(url)`` for every server at once, each on a thread of its own; returns the answers
    by URL. Raises ``ServerError`` naming every server that failed -- as soon as one has (the
    others' threads finish on their own, bounded by their requests' timeouts), or naming those
    still silent after ``timeout_s``."""
    futures = {url: in_thread(partial(step, url), "weight-sync-http") for url in urls}
    wait(futures.values(), timeout=timeout_s, return_when=FIRST_EXCEPTION)
    failed: dict[str, str] = {}
    for url, future in futures.items():
        if not future.done():
            continue
        error = future.exception()
        if error is not None:
            failed[url] = (error.servers.get(url) if isinstance(error, ServerError) else None) or (
                f"{type(error).__name__}: {error}"
            )
    if failed:
        detail = "; ".join(f"{url}: {reason}" for url, reason in failed.items())
        raise ServerError(f"{what} failed on {len(failed)} server(s): {detail}", failed)
    late = [url for url, future in futures.items() if not future.done()]
    if late:
        raise ServerError(
            f"{what}: server(s) {late} did not answer within {timeout_s:.1f}s",
            dict.fromkeys(late, f"no answer within {timeout_s:.1f}s"),
        )
    return {url: future.result() for url, future in futures.items()}


def check_urls(urls: Sequence[str], engine: str) -> list[str]:
    """The servers' base URLs, normalised (``http://host:port``); ``TypeError``/``ValueError``
    saying what to write instead for anything else. ``engine`` names the servers in messages."""
    if isinstance(urls, str | bytes) or not isinstance(urls, Sequence):
        raise TypeError(
            f"urls must be a list of base URLs such as ['http://127.0.0.1:8000'], got "
            f"{type(urls).__name__}"
        )
    if not urls:
        raise ValueError(f"urls is empty: give the base URL of every {engine} server, e.g. "
                         "['http://127.0.0.1:8000']")  # fmt: skip
    checked = []
    for url in urls:
        if not isinstance(url, str):
            raise TypeError(f"every URL must be a str, got {type(url).__name__}: {url!r}")
        parts = urllib.parse.urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http(s) base URL: write it as 'http://HOST:PORT'")
        if parts.query or parts.fragment or parts.path.strip("/"):
            raise ValueError(f"{url!r} must be a server's base URL, 'http://HOST:PORT', with "
                             "no path or query (the routes are added here)")  # fmt: skip
        checked.append(f"{parts.scheme}://{parts.netloc}".lower())
    duplicates = sorted({url for url in checked if checked.count(url) > 1})
    if duplicates:
        raise ValueError(f"duplicate server URL(s) {duplicates}: list each server once")
    return checked
