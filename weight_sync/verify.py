"""Checksums for verifying that every worker holds exactly the trainer's weights."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from weight_sync.packing import byte_view


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (bit-exact; NaN payloads included)."""
    data = byte_view(tensor.detach().to("cpu").contiguous())
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(data.numpy().data)
    return digest.hexdigest()


def state_dict_digests(state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_digest(tensor) for name, tensor in state_dict.items()}
