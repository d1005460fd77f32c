"""``reload.Streamed``, the one reload a push's lanes load into, against a fake target (no
vLLM): opened by the first tensor and only then, finished or undone once, a reload that could
not open named by every later load; on a GPU with several lanes, every load on the reload's
own stream after the device settled (gpu-marked: runs as tests/gpu do, without Ray:
``pytest -m gpu tests/unit/test_streamed_reload.py``)."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import weight_sync
from weight_sync import WeightSyncError


def _reload_module() -> Any:
    """``weight_sync/adapters/vllm/reload.py`` alone: its package imports Ray (the engine
    actor), which the GPU machine's environment lacks (see tests/gpu); the module itself
    imports neither Ray nor vLLM."""
    path = Path(weight_sync.__file__).parent / "adapters" / "vllm" / "reload.py"
    spec = importlib.util.spec_from_file_location("_weight_sync_vllm_reload", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


Streamed = _reload_module().Streamed


class FakeTarget:
    """What ``Streamed`` uses of a ``ReloadTarget``, recording the steps and the CUDA stream
    each load ran on."""

    def __init__(self, opens: bool = True) -> None:
        self.steps: list[str] = []
        self.opens = opens
        self.streams: list[Any] = []
        self.loaded: dict[str, torch.Tensor] = {}

    def open(self) -> None:
        self.steps.append("open")
        if not self.opens:
            raise RuntimeError("meta device exhausted")

    def load(self, weights: Any) -> None:
        weights = list(weights)
        self.steps.append("load " + ",".join(name for name, _ in weights))
        if torch.cuda.is_available():
            self.streams.append(torch.cuda.current_stream())
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()

    def finish(self) -> None:
        self.steps.append("finish")

    def undo(self) -> None:
        self.steps.append("undo")


def tensors(*names: str) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.ones(2)) for name in names]


def test_the_first_tensor_opens_the_reload_and_close_finishes_it_once() -> None:
    target = FakeTarget()
    stream = Streamed(target, None, senders=2)  # type: ignore[arg-type]
    stream.load(tensors("a"))
    stream.load(tensors("b", "c"))
    stream.close()
    stream.close()
    assert target.steps == ["open", "load a", "load b,c", "finish"]


@pytest.mark.parametrize("end", ["close", "abort"])
def test_a_push_that_moved_no_byte_never_touches_the_model(end: str) -> None:
    target = FakeTarget()
    getattr(Streamed(target, None, senders=1), end)()  # type: ignore[arg-type]
    assert target.steps == []


def test_a_push_cut_short_is_undone_once() -> None:
    target = FakeTarget()
    stream = Streamed(target, None, senders=1)  # type: ignore[arg-type]
    stream.load(tensors("a"))
    stream.abort()
    stream.abort()
    assert target.steps == ["open", "load a", "undo"]


def test_a_reload_that_could_not_open_is_named_by_every_later_load() -> None:
    """Another lane's thread must not open it again on a model left half on the meta device."""
    target = FakeTarget(opens=False)
    stream = Streamed(target, None, senders=2)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="exhausted"):
        stream.load(tensors("a"))
    with pytest.raises(
        WeightSyncError, match="could not begin: RuntimeError: meta device exhausted"
    ):
        stream.load(tensors("b"))
    stream.abort()  # nothing opened: nothing to undo (``open`` undid its own part)
    assert target.steps == ["open"]


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_several_lanes_load_on_the_reloads_own_stream_after_every_lanes_copies() -> None:
    """Two lane threads, each on a side stream of its own, copy halves of one tensor (a long
    kernel first, so the copy is still queued when the thread hands the tensor on); the load,
    from the second thread, sees both halves and runs on neither lane's stream."""
    device = torch.device("cuda", 0)
    target = FakeTarget()
    stream = Streamed(target, device, senders=2)  # type: ignore[arg-type]
    whole = torch.empty(2, 1 << 20, device=device)
    lock = threading.Lock()
    lanes = [torch.cuda.Stream(device) for _ in range(2)]
    done = threading.Barrier(2)

    def lane(index: int) -> None:
        with torch.cuda.device(device), torch.cuda.stream(lanes[index]):
            big = torch.randn(2048, 2048, device=device)
            for _ in range(20):  # keep this lane's stream busy
                big = big @ big / 2048
            whole[index].copy_(torch.full((1 << 20,), index + 1.0, device=device))
            done.wait()
            if index == 1:
                with lock:
                    stream.load([("w", whole)])

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    stream.close()
    loaded = target.loaded["w"].cpu()
    assert bool((loaded[0] == 1.0).all()) and bool((loaded[1] == 2.0).all())
    assert all(
        s not in (lanes[0], lanes[1], torch.cuda.default_stream(device)) for s in target.streams
    )
    assert target.steps == ["open", "load w", "finish"]
