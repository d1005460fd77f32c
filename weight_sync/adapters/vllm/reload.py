"""One vLLM worker's model as the target of pushes: what it can load, and how it takes it in.

A serving vLLM model is not in checkpoint form. Its loader stacked q/k/v into ``qkv_proj`` and
gate/up into ``gate_up_proj``, and after loading it may have transformed the weights for its
kernels (on CPU, linear layers are repacked for oneDNN and the parameters left empty; quantized
engines re-quantize). A plain ``model.load_weights`` into a running engine therefore fails or,
worse, half-works. vLLM's own update path reloads layer by layer: ``initialize_layerwise_reload``
puts every layer back on the meta device in checkpoint form, each layer is rebuilt, loaded and
post-processed as soon as all of its tensors have arrived, and ``finalize_layerwise_reload``
restores the layers that received nothing. This module drives that path, once per push, and
adds the two things vLLM's path lacks:

* **A check before any byte moves.** ``ReloadTarget.check`` runs the engine's own
  ``load_weights`` on meta tensors against meta twins of its layers (the live model is never
  touched) and reports names it cannot place, shapes its loaders refuse, parameters a full
  push leaves out, and modules a push would fill only in part -- pushing ``q_proj`` alone would
  leave the rest of vLLM's stacked ``qkv_proj`` uninitialised, since a reloaded layer is rebuilt
  from scratch.
* **An undo.** If a push fails mid-way, the layers not yet rebuilt get their previous tensors
  back, so the engine keeps serving (its worker reports no version until a push repairs it)
  instead of holding meta tensors.

It leans on vLLM's layerwise-reload internals (checked against vLLM 0.32), as vLLM's own
sharded-RDT weight-transfer engine does; it runs only inside vLLM's worker processes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from weight_sync.errors import WeightSyncError, first_line
from weight_sync.wire.metadata import SyncPlan, TensorMeta

logger = logging.getLogger(__name__)

_CHECKS_CACHED = 8
_SHOWN = 5  # names listed per problem


class ReloadTarget:
    """The model of one vLLM worker, reloaded in checkpoint form. ``model`` returns it (vLLM may
    swap it: a LoRA wrapper, a draft model); ``runner``, vLLM's model runner when known, has its
    caches of what the old weights computed reset after each reload, as vLLM's own
    ``reload_weights`` does."""

    def __init__(
        self, model: Callable[[], torch.nn.Module], vllm_config: Any, runner: Any = None
    ) -> None:
        self._model = model
        self._vllm_config = vllm_config
        self._runner = runner
        self._checks: OrderedDict[tuple[str, bool], list[str]] = OrderedDict()

    @property
    def model(self) -> torch.nn.Module:
        return self._model()

    @property
    def data_parallel_size(self) -> int:
        """The engine's data-parallel replicas (vLLM's ``parallel_config``; 1 where unknown)."""
        parallel = getattr(self._vllm_config, "parallel_config", None)
        return int(getattr(parallel, "data_parallel_size", 1) or 1)

    @contextmanager
    def configured(self) -> Iterator[None]:
        """vLLM's config current, as its loaders and layers read it."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self._vllm_config):
            yield

    def check(self, plan: SyncPlan, partial: bool) -> list[str]:
        """What of ``plan`` this engine cannot load (see the module doc). Cached per plan:
        a training loop pushes the same layout every step."""
        key = (plan.digest, partial)
        if key not in self._checks:
            with self.configured(), torch.no_grad():
                self._checks[key] = problems(
                    dry_run(self.model, list(plan.metas().values())), partial
                )
            while len(self._checks) > _CHECKS_CACHED:
                self._checks.popitem(last=False)
        return self._checks[key]

    @contextmanager
    def reload(self) -> Iterator[None]:
        """One reload of the whole model: every ``load`` inside lands, layer by layer, when the
        window closes normally; a window left by an exception undoes the layers not yet
        rebuilt."""
        self.open()
        try:
            yield
        except BaseException:
            self.undo()
            raise
        self.finish()

    def open(self) -> None:
        """Begin a reload: every layer back on the meta device in checkpoint form (undone where
        that fails part-way)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with self.configured(), torch.no_grad():
            try:
                initialize_layerwise_reload(self.model)
            except BaseException:
                _undo_reload(self.model)
                raise

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hand tensors to the engine's own loader (which stacks and shards them). Only inside
        a reload; vLLM may keep them until their layer is complete."""
        with self.configured(), torch.no_grad():
            self.model.load_weights(weights)  # type: ignore[operator]

    def finish(self) -> None:
        """End a reload: the layers that received nothing restored, every layer processed for
        the engine's kernels (where that fails, the layers not yet rebuilt are undone)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with self.configured(), torch.no_grad():
            try:
                finalize_layerwise_reload(self.model, self._vllm_config.model_config)
            except BaseException:
                _undo_reload(self.model)
                raise
        self._reset_runner()

    def undo(self) -> None:
        """Leave a reload cut short: the layers not yet rebuilt get their old tensors back."""
        with self.configured(), torch.no_grad():
            _undo_reload(self.model)
        self._reset_runner()  # some layers may have been rebuilt with new weights

    def _reset_runner(self) -> None:
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            getattr(self._runner, reset, lambda: None)()


class Streamed:
    """One reload of ``target`` for a push whose tensors arrive from the lanes of its
    ``senders``: each lane's thread hands the tensors it completed to ``load`` (one call at a
    time: the ``Assembly`` serialises them), the first opening the reload -- so a push refused
    or called off before any byte moves never touches the model -- and each loaded at once,
    layer after layer rebuilt as its tensors are complete, as one sender's streamed push loads:
    the memory of a layer's tensors, never of the whole push. ``close`` finishes the reload;
    ``abort`` undoes what it has not rebuilt (``ReloadTarget.undo``).

    On a GPU, one lane's loads run on its receive stream, as one sender's do. Several lanes
    copy into a tensor on their own streams, and vLLM keeps a layer's tensors to read them on
    whichever lane's thread completes the layer: there every load waits for the device (every
    lane's copies done) and runs on a stream of the reload's own, which each tensor it is handed
    is recorded on, so that none is freed for reuse while the reload may still read it."""

    def __init__(self, target: ReloadTarget, device: torch.device | None, senders: int) -> None:
        self._target, self._device = target, device
        on_gpu = device is not None and device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if on_gpu and senders > 1 else None
        self._opened = False
        self._broken: str | None = None  # why the reload could not open: later loads say so

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self._broken is not None:
            raise WeightSyncError(f"the engine's reload could not begin: {self._broken}")
        weights = list(weights)
        with self._scope(weights):
            if not self._opened:
                try:
                    self._target.open()
                except Exception as exc:
                    self._broken = first_line(exc)
                    raise
                self._opened = True
            self._target.load(weights)

    def close(self) -> None:
        if self._opened:
            self._opened = False
            with self._scope([]):
                self._target.finish()

    def abort(self) -> None:
        if self._opened:
            self._opened = False
            with self._scope([]):
                self._target.undo()

    @contextmanager
    def _scope(self, weights: Sequence[tuple[str, torch.Tensor]]) -> Iterator[None]:
        """Where the reload's work runs: on a lane's thread (no CUDA device of the worker's
        own), on the worker's device; with several lanes, on the reload's stream (see the
        class), the device settled again after."""
        if self._device is None or self._device.type != "cuda":
            yield
            return
        with torch.cuda.device(self._device):
            if self._stream is None:
                yield
                return
            torch.cuda.synchronize(self._device)
            for _, tensor in weights:
                tensor.record_stream(self._stream)
            with torch.cuda.stream(self._stream):
                yield
            if not weights:  # the reload's end: the engine's own stream reads what it left
                torch.cuda.synchronize(self._device)


class DryRun:
    """What ``load_weights`` did with a push of meta tensors: the first error (naming the
    tensor being loaded), the parameters it reported loaded, every parameter of the model, and
    per module the elements loaded against the elements its loaders can take."""

    def __init__(self) -> None:
        self.error: str | None = None
        self.loaded: set[str] = set()
        self.parameters: set[str] = set()
        self.filled: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # module -> [loaded, size]
        self.sources: dict[str, list[str]] = defaultdict(list)  # module -> names loaded into it


def dry_run(model: torch.nn.Module, metas: Sequence[TensorMeta]) -> DryRun:
    """Load meta tensors shaped as ``metas`` into meta twins of ``model``'s layers, with the
    model's own loaders, counting what lands where. The live tensors are swapped out only for
    the duration and put back exactly; none is read or written."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    result = DryRun()
    saved: list[tuple[torch.nn.Module, dict, dict]] = []
    current: list[str] = [""]  # the name being loaded
    try:
        for module_name, module in model.named_modules():
            saved.append((module, dict(module._parameters), dict(module._buffers)))
            size = 0
            # Twins of its own for every module, tied ones too: vLLM reloads and post-processes
            # each module alone, so a module that is sent nothing keeps what it derived from its
            # old weights even where it shares a parameter with one that was reloaded (on CPU,
            # a tied LM head keeps its own packed copy of the embedding).
            for table, form in zip(
                (module._parameters, module._buffers), _reload_form(module), strict=True
            ):
                table.clear()
                for name, tensor in form.items():
                    table[name] = twin = _twin(tensor, module)
                    if table is module._parameters:
                        _count_loads(twin, module_name, result, current)
                    if name not in SKIP_LOAD_TENSORS:
                        size += _load_numel(twin)
            result.filled[module_name][1] = size - _vocab_padding(module)
        result.parameters = {name for name, _ in model.named_parameters()}
        pushed = (
            (meta.name, torch.empty(meta.shape, dtype=meta.torch_dtype, device="meta"))
            for meta in metas
        )
        try:
            result.loaded = set(model.load_weights(_tracking(pushed, current)) or ())  # type: ignore[operator]
        except Exception as exc:
            detail = str(exc).splitlines()[0][:300] if str(exc) else ""
            what = f"{current[0]!r}: " if current[0] else ""
            result.error = (
                f"{what}the engine's load_weights refused it ({type(exc).__name__}"
                f"{': ' + detail if detail else ''}); check its name and shape"
            )
    finally:
        for module, params, buffers in saved:
            module._parameters.clear()
            module._parameters.update(params)
            module._buffers.clear()
            module._buffers.update(buffers)
    return result


def problems(run: DryRun, partial: bool) -> list[str]:
    """A dry run's findings as the reasons a push is refused."""
    if run.error is not None:
        return [run.error]
    found = []
    for module, (loaded, size) in sorted(run.filled.items()):
        if 0 < loaded < size:
            parts = ", ".join(repr(n) for n in run.sources[module][:_SHOWN])
            found.append(
                f"the engine's {module!r} would be filled only in part ({loaded} of {size} "
                f"elements, from {parts}): vLLM stacks several checkpoint tensors into it and "
                "rebuilds it whole on reload, so push all of its parts together"
            )
    if not partial:
        missing = sorted(run.parameters - run.loaded)
        found.extend(
            f"missing tensor: the engine's {name!r} gets nothing from this push (push "
            "every weight -- tied ones too: a state dict names them, and they travel "
            "once -- or pass partial=True)"
            for name in missing
        )
    return found


def _reload_form(
    module: torch.nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The parameters and buffers ``module`` holds while vLLM reloads it (see its
    ``restore_layer_on_meta``): the checkpoint-form metadata recorded when the model was
    loaded, plus the live tensors the reload leaves in place. A module with no recorded form
    keeps its live tensors."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

    live: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = (
        {n: t for n, t in module._parameters.items() if t is not None},
        {n: t for n, t in module._buffers.items() if t is not None},
    )
    info = LAYERWISE_INFO.get(module)
    if info is None or not any(info.restore_metadata):
        return live
    return tuple(  # type: ignore[return-value]
        {
            **{n: t for n, t in now.items() if n in SKIP_TENSORS},
            **{n: t for n, t in recorded.items() if n not in SKIP_TENSORS},
        }
        for now, recorded in zip(live, info.restore_metadata, strict=True)
    )


def _twin(tensor: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """A meta tensor shaped like ``tensor``, of its class and with its attributes (its
    ``weight_loader``), bound to ``module`` as vLLM binds its restored tensors."""
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    twin = torch.empty_strided(
        tuple(tensor.size()), tuple(tensor.stride()), dtype=tensor.dtype, device="meta"
    )
    twin.__class__ = tensor.__class__
    twin.__dict__ = dict(tensor.__dict__)
    return restore_layer_refs(twin, module)


def _count_loads(twin: torch.Tensor, module_name: str, run: DryRun, current: list[str]) -> None:
    """Give ``twin`` a loader that runs its real one (unwrapped from any reload wrapper left by
    an earlier reload) and counts the elements it copies in, as vLLM's reload does."""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader
    from vllm.model_executor.model_loader.reload.meta import CopyCounter

    loader: Callable[..., Any] = _get_original_loader(twin)
    cap = _load_numel(twin)

    def counting_loader(*args: Any, **kwargs: Any) -> Any:
        with CopyCounter() as counter:
            result = loader(*args, **kwargs)
        run.filled[module_name][0] += min(counter.copied_numel, cap)
        if current[0] not in run.sources[module_name]:
            run.sources[module_name].append(current[0])
        return result

    twin.weight_loader = counting_loader  # type: ignore[attr-defined]


def _vocab_padding(module: torch.nn.Module) -> int:
    """Elements of a vocabulary-parallel layer (embedding, LM head) that no checkpoint fills:
    the rows padding its vocabulary to the kernels' multiple (a vocabulary of 12 is held as 64
    rows). vLLM's reload counts them as unloaded and rebuilds such a layer at the end of the
    reload, which is harmless: the rows are never read."""
    indices, dim = getattr(module, "shard_indices", None), getattr(module, "embedding_dim", None)
    if indices is None or not isinstance(dim, int):
        return 0
    return int(indices.num_elements_padded - indices.num_org_elements) * dim


def _load_numel(tensor: torch.Tensor) -> int:
    from vllm.model_executor.model_loader.reload.utils import get_tensor_load_numel

    return int(get_tensor_load_numel(tensor))


def _tracking(
    pushed: Iterator[tuple[str, torch.Tensor]], current: list[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in pushed:
        current[0] = name
        yield name, tensor
    current[0] = ""


def _undo_reload(model: torch.nn.Module) -> None:
    """Leave a reload cut short: layers still waiting for tensors (on the meta device) get
    their previous tensors back; layers already rebuilt keep their new ones."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        LAYERWISE_INFO,
        LOADING_LAYERS,
        _place_kernel_tensors,
    )

    for module in model.modules():
        info = LAYERWISE_INFO.get(module)
        if info is not None and info.can_load():
            if info.kernel_tensors is not None:
                _place_kernel_tensors(module, info)
            info.reset()
    LOADING_LAYERS.clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload  # type: ignore[assignment]
    logger.warning("a weight reload was cut short: layers not yet rebuilt keep their old weights")
