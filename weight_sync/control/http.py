"""Inference servers over HTTP, with the standard library only: one call, the same call to many
servers at once, and the answers gathered (a failure raises ``errors.ServerError``, naming the
servers).

Shared by the adapters that drive servers without Ray (``vllm serve``, SGLang's
``launch_server``). Answers are small JSON, read up to ``MAX_BODY`` bytes; nothing is
unpickled. Proxies from the environment are bypassed: they would route loopback and
cluster-internal addresses through a proxy that cannot reach them.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

from weight_sync.control.futures import gather, in_thread
from weight_sync.errors import ServerError, SyncTimeoutError

__all__ = ["MAX_BODY", "call", "check_urls", "collect_answers", "fan_out", "reason"]

MAX_BODY = 1 << 20  # the largest answer read from a server (the routes we call answer tiny JSON)
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
# Routes called without a body that are reads (``GET``); any other call without one is a POST.
_GETS = frozenset(
    {"weight_info", "get_world_size", "is_paused", "health", "model_info", "server_info"}
)


def call(
    url: str,
    path: str,
    body: Mapping[str, Any] | None = None,
    *,
    timeout_s: float,
    method: str | None = None,
    text: bool = False,
) -> Any:
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
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, garbled
        reason = getattr(exc, "reason", exc)
        raise _failed(url, f"{verb} /{path}: {type(reason).__name__}: {reason}") from exc
    if text:
        return raw.decode(errors="replace")
    try:
        return json.loads(raw) if raw.strip() else None
    except ValueError as exc:
        raise _failed(url, f"{verb} /{path}: not JSON: {raw[:200]!r}") from exc


def unanswered(error: BaseException) -> bool:
    """Whether ``error`` (a ``call``'s) is one the server never answered -- refused, reset,
    closed, timed out: its process gone or stuck -- rather than an HTTP error it answered."""
    cause = error.__cause__
    answered = isinstance(cause, urllib.error.HTTPError)
    return isinstance(cause, OSError | http.client.HTTPException) and not answered


def _failed(url: str, reason: str) -> ServerError:
    return ServerError(f"server {url} failed: {reason}", {url: reason})


def fan_out(
    urls: Sequence[str],
    step: Callable[[str], Any],
    timeout_s: float,
    what: str,
    *,
    settle: bool = True,
) -> dict[str, Any]:
    """``step(url)`` for every server at once, each on a thread of its own; returns the answers
    by URL (see ``collect_answers``). Settled unless told otherwise: a call a server answers
    alone, still in flight when another server failed, would land after the caller's next step
    (a pause after the release's resume, a resume after the next push's pause). ``settle=False``
    for calls that wait on one another (forming a group, its bytes): theirs end only once the
    caller, told of the failure, tears the group down."""
    calls = {url: in_thread(partial(step, url), "weight-sync-http") for url in urls}
    return collect_answers(calls, timeout_s, what, settle=settle)


def collect_answers(
    calls: Mapping[str, Future[Any]],
    timeout_s: float,
    what: str,
    *,
    who: str = "server(s)",
    also: Future[Any] | None = None,
    until_also: bool = False,
    settle: bool = False,
) -> dict[str, Any]:
    """The answers of ``calls`` (one per server, by name) once all are in -- and ``also``, the
    caller's own part, done -- within ``timeout_s``; with ``until_also``, as soon as ``also`` is
    done (the calls go on). ``ServerError`` names every server whose call failed as soon as one
    has (before ``also``'s error: a server that failed is the better lead), or that had not
    answered in time; ``SyncTimeoutError`` if only ``also`` is late. ``who`` names the servers
    in messages. ``settle``: a failure does not end the wait, every call is let finish (within
    ``timeout_s``) -- for calls whose effect the caller undoes after a failure: a pause still
    in flight when one server refused would land after the resume that undoes it, and leave a
    live server paused."""
    futures = [*calls.values(), *([also] if also is not None else [])]

    def over() -> bool:
        if not settle and any(
            future.done() and future.exception() is not None for future in futures
        ):
            return True
        if until_also:
            return also is not None and also.done()
        return all(future.done() for future in futures)

    gather(futures, timeout_s, until=over)
    failed = {
        name: reason(name, future.exception())
        for name, future in calls.items()
        if future.done() and future.exception() is not None
    }
    if failed:
        detail = "; ".join(f"{name}: {why}" for name, why in failed.items())
        raise ServerError(f"{what} failed on {len(failed)} {who}: {detail}", failed)
    if also is not None and also.done():
        if also.exception() is not None:
            raise also.exception()  # type: ignore[misc]
        if until_also:
            return {}
    late = [name for name, future in calls.items() if not future.done()]
    if not late and not until_also and (also is None or also.done()):
        return {name: future.result() for name, future in calls.items()}
    if until_also or not late:  # the caller's part is late: the servers wait on it
        raise SyncTimeoutError(
            f"{what}: the trainer's part did not finish within {timeout_s:.1f}s while "
            f"{who} {late} waited; check the trainer's network and the servers' logs, "
            "or raise the timeouts in SyncConfig"
        )
    raise ServerError(
        f"{what}: {who} {late} did not answer within {timeout_s:.1f}s",
        dict.fromkeys(late, f"no answer to {what} within {timeout_s:.1f}s"),
    )


def reason(name: str, error: BaseException | None) -> str:
    """Why ``name`` failed: its own entry of a ``ServerError``, else the error itself."""
    if isinstance(error, ServerError) and name in error.servers:
        return error.servers[name]
    return f"{type(error).__name__}: {error}"


def check_urls(urls: Sequence[str], engine: str) -> list[str]:
    """The servers' base URLs, normalised (``http://host:port``); ``TypeError``/``ValueError``
    saying what to write instead for anything else. ``engine`` names the servers in messages."""
    if isinstance(urls, str | bytes) or not isinstance(urls, Sequence):
        raise TypeError(
            f"urls must be a list of base URLs such as ['http://127.0.0.1:8000'], got "
            f"{type(urls).__name__}"
        )
    if not urls:
        raise ValueError(
            f"urls is empty: give the base URL of every {engine} server, e.g. "
            "['http://127.0.0.1:8000']"
        )
    checked = []
    for url in urls:
        if not isinstance(url, str):
            raise TypeError(f"every URL must be a str, got {type(url).__name__}: {url!r}")
        parts = urllib.parse.urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http(s) base URL: write it as 'http://HOST:PORT'")
        if parts.query or parts.fragment or parts.path.strip("/"):
            raise ValueError(
                f"{url!r} must be a server's base URL, 'http://HOST:PORT', with "
                "no path or query (the routes are added here)"
            )
        checked.append(f"{parts.scheme}://{parts.netloc}".lower())
    duplicates = sorted({url for url in checked if checked.count(url) > 1})
    if duplicates:
        raise ValueError(f"duplicate server URL(s) {duplicates}: list each server once")
    return checked
