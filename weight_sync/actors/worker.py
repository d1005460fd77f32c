"""``WeightSyncWorker``: the base class an inference-worker Ray actor inherits.

The public surface is the contract -- ``load_weights`` and ``weights_version`` -- plus
``weight_sync_*`` helpers. The protocol methods the updater calls are ``_weight_sync_*``, so the
library never takes a name a user's engine class is likely to define.
"""

from __future__ import annotations

import inspect
import os
import socket
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from weight_sync.metadata import (
    GroupSpec,
    MemberInfo,
    PrepareReply,
    ReceiveReport,
    TensorMeta,
)
from weight_sync.receiver import Receiver
from weight_sync.verify import state_dict_digests

_MAX_SPEC_CHARS = 4096


class WeightSyncWorker:
    """Mix into an inference actor: ``@ray.remote class Engine(WeightSyncWorker)``.

    By default received weights are copied, by name, into ``self.model`` (any ``nn.Module``),
    and every push is checked against its state dict before any data moves. Override
    :meth:`load_weights` to load elsewhere (an inference engine, renamed parameters); then
    override :meth:`weight_sync_expected` too if pushes should be checked up front.
    """

    def __init__(self) -> None:
        self._weight_sync_receiver = Receiver()

    # -- the contract --------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(name, tensor)`` pairs into ``self.model``. Called once per bucket, for the
        tensors that could not land in place (see ``weight_sync_destinations``); the tensors are
        views into a receive buffer, valid only during the call."""
        targets = self._weight_sync_model().state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                targets[name].copy_(tensor)

    def weights_version(self) -> int | None:
        """The version of the last fully received and committed push; ``None`` before the
        first one and while the weights are partly updated or a push failed part-way."""
        return self._weight_sync_state().version

    # -- helpers users may call or override ------------------------------------------------------

    def weight_sync_expected(self) -> Mapping[str, TensorMeta] | None:
        """What a push must contain (name -> dtype and shape), checked before any data moves.

        Default: ``self.model``'s state dict when ``load_weights`` is the default one; ``None``
        (accept any push) when ``load_weights`` is overridden.
        """
        if self._weight_sync_custom_load():
            return None
        return {
            name: TensorMeta.of(name, tensor)
            for name, tensor in self._weight_sync_model().state_dict().items()
        }

    def weight_sync_destinations(self) -> Mapping[str, torch.Tensor] | None:
        """Tensors that received bytes may be written into directly, skipping ``load_weights``
        and any staging copy (used where contiguous, same dtype, shape and device).

        Default: ``self.model``'s state dict when ``load_weights`` is the default one, else
        ``None`` (everything goes through ``load_weights``).
        """
        if self._weight_sync_custom_load():
            return None
        return self._weight_sync_model().state_dict()

    def weight_sync_digests(self) -> dict[str, str]:
        """SHA-256 of every tensor of ``self.model``'s state dict, to compare with the trainer's."""
        return state_dict_digests(self._weight_sync_model().state_dict())

    # -- protocol, called by WeightUpdater -------------------------------------------------------

    def _weight_sync_info(self) -> MemberInfo:
        return MemberInfo(
            has_default_group=dist.is_available() and dist.is_initialized(),
            cuda=torch.cuda.is_available(),
            version=self._weight_sync_state().version,
            hostname=socket.gethostname(),
            pid=os.getpid(),
        )

    def _weight_sync_join(self, spec_json: str, max_metadata_bytes: int) -> None:
        if len(spec_json) > _MAX_SPEC_CHARS:
            raise ValueError("group spec too large")
        self._weight_sync_state().join(GroupSpec.model_validate_json(spec_json), max_metadata_bytes)

    def _weight_sync_prepare(self, request_json: str) -> PrepareReply:
        return self._weight_sync_state().prepare(request_json, self.weight_sync_expected)

    def _weight_sync_receive(self, version: int) -> ReceiveReport:
        state = self._weight_sync_state()
        return state.receive(version, self.load_weights, self.weight_sync_destinations())

    def _weight_sync_commit(self, version: int) -> None:
        self._weight_sync_state().commit(version)

    def _weight_sync_leave(self) -> None:
        self._weight_sync_state().leave()

    # -- internals -----------------------------------------------------------------------------

    def _weight_sync_state(self) -> Receiver:
        # Tolerates a subclass that forgot super().__init__().
        receiver = self.__dict__.get("_weight_sync_receiver")
        if receiver is None:
            receiver = self._weight_sync_receiver = Receiver()
        return receiver

    def _weight_sync_custom_load(self) -> bool:
        return inspect.unwrap(type(self).load_weights) is not WeightSyncWorker.load_weights

    def _weight_sync_model(self) -> torch.nn.Module:
        model = getattr(self, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise AttributeError(
                f"{type(self).__name__} has no `self.model` nn.Module; set one in __init__ or "
                "override load_weights (and weight_sync_expected)"
            )
        return model
