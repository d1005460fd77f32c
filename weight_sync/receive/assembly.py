"""A member's side of a push from K senders (one or many): each lane's blocks, written where
they belong.

Each lane (one sender's share of a push, received by a ``Receiver`` of its own) is an ordinary
push of the blocks that sender holds, named by their tensors' names and shaped as the blocks.
``Assembly`` turns the member's target -- its model's tensors, or a ``load_weights`` -- into what
each lane's Receiver needs: the check of the lane's plan against the lane's blocks, where each
block lands (a view of the model's tensor: written in place where the view is contiguous, copied
into where it is not), and, for a member that only loads, full tensors put together from every
lane's blocks and handed on once complete -- a tensor one block holds whole (every tensor of a
push from one sender) is handed on as it came, with no copy.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from pydantic import ValidationError

from weight_sync.receive.buckets import Targets
from weight_sync.receive.checks import Check, check_layout, check_plan, expecting
from weight_sync.wire.blocks import Block, BlockLayout, view_of
from weight_sync.wire.metadata import SyncPlan, TensorMeta

if TYPE_CHECKING:
    from weight_sync.receive.receiver import Receiver

Load = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


class Assembly:
    """The lanes of one layout into one target: ``destinations`` (the model's tensors by name,
    written in place) or, without them, ``load`` (handed each tensor whole, once all its blocks
    have come, from whichever lane's thread completed it: calls are serialised). ``keeps``:
    ``load`` holds on to what it is handed past the call (a vLLM reload keeps a layer's tensors
    until the layer is complete), so its lanes must hand it tensors of its own, never views
    into receive buffers a later bucket reuses (``buckets.Loader.keeps``)."""

    def __init__(
        self,
        layout: BlockLayout,
        destinations: Mapping[str, torch.Tensor] | None,
        load: Load | None = None,
        keeps: bool = False,
    ) -> None:
        assert (destinations is None) != (load is None), "a model's tensors, or a load_weights"
        self.layout, self.keeps = layout, keeps
        self._destinations = destinations
        self._load = load
        self._lock = threading.Lock()
        self._parts: dict[str, tuple[torch.Tensor, int]] = {}  # tensor being put together, left
        self._views: dict[int, dict[str, torch.Tensor]] = {}  # each lane's, made once
        self._targets: Targets | None = None  # what identifies the destinations (``serves``)
        self._accepted: dict[int, tuple[str, bool]] = {}  # each lane's plan it took last
        # A loader is handed every tensor, those of no element too (no block carries them), as
        # one sender's pushes hand them: with the first tensors it is handed.
        self._empty = [meta for meta in layout.tensors if not math.prod(meta.shape)] if load else []

    def serves(self, layout: BlockLayout, destinations: Mapping[str, torch.Tensor]) -> bool:
        """Whether this assembly takes ``layout`` into ``destinations`` as well: the same
        layout into the very same tensors, at the same addresses -- its views of them hold, so
        a member reuses it push after push rather than make them anew (a tenth of a small
        push's time on a member before its vote)."""
        if self._destinations is None or layout.digest != self.layout.digest:
            return False
        if self._targets is None:
            self._targets = Targets.of(self._destinations)
        return Targets.of(destinations, self._targets) is self._targets

    def problems(self, record: Receiver) -> list[str]:
        """What in the layout the target cannot take (names, dtypes, global shapes), the member
        holding ``record``'s version (``checks.check_layout``). A loader takes any names; a
        layout ``record`` accepted last into the very same tensors is not checked against them
        again (``Receiver.remembered``)."""
        check = expecting(lambda: self._destinations)
        if self._destinations is not None:
            key = record.targets(self._destinations)
            check = record.remembered(check, key, self.layout.digest)
        return check_layout(self.layout, check, record.version)

    def check(self, sender: int) -> Check:
        """A lane's plan must carry exactly the blocks the layout gives its sender: checked
        once per plan (and partial flag) it accepts, not again on the pushes after it that this
        assembly serves (``serves``) -- a third of a small push's own work on a member."""
        blocks = self.layout.lane_tensors(sender)

        def checked(plan: SyncPlan, partial: bool) -> list[str]:
            if self._accepted.get(sender) == (plan.digest, partial):
                return []
            problems = check_plan(plan, blocks, partial)
            if not problems:
                self._accepted[sender] = (plan.digest, partial)
            return problems

        return checked

    def destinations(self, sender: int) -> dict[str, torch.Tensor] | None:
        """Each block of the lane as a view of the model's tensor (None for a loader; a whole
        tensor's block, the tensor itself: ``view_of``). Made once: a lane's receive asks for
        them twice (where bytes land in place, what the rest is copied into), and an assembly
        may serve push after push (``serves``)."""
        if self._destinations is None:
            return None
        if sender not in self._views:
            self._views[sender] = {
                meta.name: view_of(self._destinations[meta.name], block)
                for block, meta in self._blocks(sender)
            }
        return self._views[sender]

    def loader(self, sender: int) -> Load:
        """What takes the blocks that could not land in place: copied into their views of the
        model, or put together into whole tensors for ``load``."""
        views = self.destinations(sender)
        if views is not None:

            def into_views(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
                with torch.no_grad():
                    for name, tensor in weights:
                        views[name].copy_(tensor)

            return into_views
        blocks = {meta.name: (block, meta) for block, meta in self._blocks(sender)}
        return lambda weights: self._put_together(weights, blocks)

    def forget(self) -> None:
        """After a failed push: drop the tensors left half put together."""
        with self._lock:
            self._parts.clear()

    def _put_together(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        blocks: Mapping[str, tuple[Block, TensorMeta]],
    ) -> None:
        assert self._load is not None
        complete: list[tuple[str, torch.Tensor]] = []
        device: torch.device | None = None
        for name, tensor in weights:
            device = tensor.device
            block, meta = blocks[name]
            if block.numel == math.prod(meta.shape):  # the whole tensor: handed on as it came
                complete.append((name, tensor))
                continue
            with self._lock:
                if name not in self._parts:
                    whole = torch.empty(meta.shape, dtype=meta.torch_dtype, device=tensor.device)
                    self._parts[name] = (whole, math.prod(meta.shape))
                whole = self._parts[name][0]
            # Outside the lock: the lanes' blocks of one tensor never overlap, so K lanes copy
            # at once; only who completes a tensor is decided under it.
            view_of(whole, block).copy_(tensor)
            with self._lock:
                _, left = self._parts[name]
                left -= block.numel
                if left:
                    self._parts[name] = (whole, left)
                else:
                    del self._parts[name]
                    complete.append((name, whole))
        if complete:
            with self._lock:
                empty, self._empty = self._empty, []
                complete += [
                    (meta.name, torch.empty(meta.shape, dtype=meta.torch_dtype, device=device))
                    for meta in empty
                ]
                self._load(complete)

    def _blocks(self, sender: int) -> list[tuple[Block, TensorMeta]]:
        return [(b, self.layout.tensors[b.tensor]) for b in self.layout.sent_by(sender)]


def layout_of_push(
    layout_json: str | None, digest: str, held: BlockLayout | None, max_metadata_bytes: int
) -> BlockLayout | str:
    """The layout of the push ``digest`` names, at a member: the one sent (``layout_json``:
    bounded, validated, and the one named), else the one it ``held``; or what is wrong."""
    layout = held
    if layout_json is not None:
        if len(layout_json) > max_metadata_bytes:
            return (
                f"a layout of {len(layout_json)} bytes exceeds max_metadata_bytes="
                f"{max_metadata_bytes}: raise it in SyncConfig"
            )
        try:
            layout = BlockLayout.model_validate_json(layout_json)
        except ValidationError as exc:
            return f"malformed layout: {exc.errors()[0]['msg']}"
    if layout is None or layout.digest != digest:
        return "this member does not hold the push's layout (it restarted?): push again"
    return layout


class Refusal(Assembly):
    """A push a member cannot take (its check found ``problems``: a user's hook that raised is
    one): every lane refuses it as it opens, so nothing moves anywhere and each sender learns
    why at once -- every member refusing every lane alike, the senders all raise the same
    refusal."""

    def __init__(self, layout: BlockLayout, problems: Sequence[str]) -> None:
        super().__init__(layout, None, _refused)
        self._problems = list(problems)

    def check(self, sender: int) -> Check:
        return lambda plan, partial: list(self._problems)


def _refused(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    raise AssertionError("a refused push loads nothing")
