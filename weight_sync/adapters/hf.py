"""A weight_sync worker around any Hugging Face ``transformers`` model.

Name the model and you have an inference worker: ``RemoteHFWorker.remote("Qwen/Qwen2.5-0.5B")``
(or a config, for a model built in code). Its parameter names are the ones the trainer's copy
of the same model has, so pushes need no mapping; tied embeddings stay tied (they travel once,
see ``WeightUpdater.push``). Rollouts come back tagged with the weight version that made them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from weight_sync.actors.worker import WeightSyncWorker, remote_worker


@dataclass(frozen=True)
class Generation:
    """Sequences (prompt + completion token ids) and the committed weight version that
    produced them (``None`` if the worker held no committed version)."""

    sequences: torch.Tensor
    version: int | None


class HFWorker(WeightSyncWorker):
    """Wraps a ``transformers`` model as ``self.model``: the default ``load_weights`` copies
    pushes into it by name, in place, and checks every push against its state dict first.

    ``model``: a hub id or local path (``from_pretrained``), a ``PretrainedConfig``, or a dict
    of config fields with a ``model_type`` (both built with random weights: the first push
    brings the real ones). ``model_class`` names the ``transformers`` auto class.
    """

    def __init__(
        self,
        model: str | dict[str, Any] | Any,
        *,
        model_class: str = "AutoModelForCausalLM",
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        **from_pretrained: Any,
    ) -> None:
        super().__init__()
        self.model = load_model(model, model_class, **from_pretrained)
        if dtype is not None or device is not None:
            self.model.to(device=device, dtype=dtype)
        self.model.eval()

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, **generate_kwargs: Any) -> Generation:
        """``model.generate`` on ``input_ids`` (batch, length); any ``generate`` option passes
        through. The version is read with the weights it describes: a push commits between
        calls, never during one."""
        version = self.weights_version()
        device = next(self.model.parameters()).device
        input_ids = input_ids.to(device)
        generate_kwargs.setdefault("attention_mask", torch.ones_like(input_ids))
        model: Any = self.model  # a transformers GenerationMixin
        sequences = model.generate(input_ids, **generate_kwargs)
        return Generation(sequences.cpu(), version)


RemoteHFWorker = remote_worker(num_cpus=0)(HFWorker)
"""``HFWorker`` as a Ray actor class with weight_sync's concurrency groups; add resources with
``RemoteHFWorker.options(num_gpus=1)``."""


def load_model(
    model: str | dict[str, Any] | Any,
    model_class: str = "AutoModelForCausalLM",
    **from_pretrained: Any,
) -> torch.nn.Module:
    """A ``transformers`` model from a name or path, a config, or a dict of config fields."""
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as exc:
        raise ImportError(
            "the Hugging Face adapter needs transformers: pip install 'weight_sync[hf]'"
        ) from exc
    auto = getattr(transformers, model_class, None)
    if auto is None:
        raise ValueError(
            f"transformers has no {model_class!r}; name an auto class such as "
            "'AutoModelForCausalLM'"
        )
    if isinstance(model, str):
        return auto.from_pretrained(model, **from_pretrained)
    if from_pretrained:
        raise TypeError(f"{sorted(from_pretrained)} only apply when loading a model by name")
    if isinstance(model, dict):
        fields = dict(model)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError("a config dict needs a 'model_type' (e.g. 'qwen2', 'llama')")
        model = transformers.AutoConfig.for_model(model_type, **fields)
    if not isinstance(model, transformers.PretrainedConfig):
        raise TypeError(
            f"model must be a name, a PretrainedConfig or a dict, not {type(model).__name__}"
        )
    return auto.from_config(model)
