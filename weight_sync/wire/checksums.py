"""Checksums, both kinds: a bucket's 64-bit checksum, computed where its bytes are (any device,
the same value everywhere) so a push can compare what every worker received with what was sent;
and a tensor's SHA-256, for checking afterwards that every worker holds exactly the trainer's
weights (the demo, the job, the tests).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from weight_sync.wire.packing import byte_view, read_values

# The checksum's constants: columns of the word matrix, and odd multipliers (as int64) that mix
# its three sums into one word.
_SUM_COLUMNS = 1024
_MIX = (-7046029254386353131, -4658895280553007687, 6364136223846793005)


Checksum = torch.Tensor | int


def device_checksum(data: torch.Tensor) -> torch.Tensor:
    """A 64-bit checksum of a uint8 buffer, as a one-element int64 tensor on ``data``'s device,
    computed there without any host synchronisation: the GPU pipelines of a push queue it
    behind each bucket and read every bucket's at once, after the push's one sync (see
    ``read_checksums``).

    The bytes are read as int64 words laid out in rows of ``_SUM_COLUMNS``; the checksum mixes
    the sum of all words, the sum of the row sums weighted by row number and the sum of the
    column sums weighted by column number (a word moved to another place changes one of the
    weighted sums), and the length. Only integer additions and multiplications modulo 2^64 are
    used, which give the same result in any order: so the CPU and every GPU compute the same
    value, whichever device the trainer and each worker hold their buffers on
    (``host_checksum`` computes it in NumPy). It reads the bytes twice.
    """
    assert data.dtype == torch.uint8 and data.dim() == 1 and data.is_contiguous()
    size = data.numel()
    if data.storage_offset() % 8:  # int64 views need an aligned start
        data = data.clone()
    whole = size - size % 8
    words = data[:whole].view(torch.int64)
    rows = words.numel() // _SUM_COLUMNS
    body = words[: rows * _SUM_COLUMNS].view(rows, _SUM_COLUMNS)
    rest = words[rows * _SUM_COLUMNS :]
    if whole < size:  # the last bytes, as one zero-padded word
        tail = torch.zeros(8, dtype=torch.uint8, device=data.device)
        tail[: size - whole] = data[whole:]
        rest = torch.cat([rest, tail.view(torch.int64)])
    row_sums = body.sum(dim=1)

    def weights(count: int) -> torch.Tensor:  # 1, 2, ..., count
        return torch.arange(1, count + 1, dtype=torch.int64, device=data.device)

    total = row_sums.sum() + rest.sum()
    by_row = (row_sums * weights(rows)).sum() + rest.sum() * (rows + 1)
    by_column = (body.sum(dim=0) * weights(_SUM_COLUMNS)).sum() + (
        rest * weights(rest.numel())
    ).sum()
    mixed = total * _MIX[0] + by_row * _MIX[1] + by_column * _MIX[2] + size
    return mixed.reshape(1)


def checksum_of(data: torch.Tensor) -> Checksum:
    """``data``'s checksum as soon as it can be had without a host synchronisation: an int for
    a host buffer, a device tensor for a GPU one (``read_checksums`` reads those)."""
    return host_checksum(data) if data.device.type == "cpu" else device_checksum(data)


def checksum(data: torch.Tensor) -> int:
    """``data``'s checksum, now (for a GPU buffer, a host synchronisation)."""
    return host_checksum(data) if data.device.type == "cpu" else int(device_checksum(data).item())


def host_checksum(data: torch.Tensor) -> int:
    """``device_checksum`` of a host buffer, computed in NumPy to the same value: as fast as
    torch on large buffers and 2-3x faster on small ones, whose cost is mostly calls (measured
    on 2 cores, medians: 32 MiB in 4-6 ms either way, CRC32 11-18 ms; 64 KiB in 0.07-0.09 ms
    against 0.14-0.2 ms -- a delta push checksums thousands of small ranges).
    tests/unit/test_packing.py holds the two to the same answers."""
    assert data.dtype == torch.uint8 and data.dim() == 1 and data.is_contiguous()
    raw = data.numpy()
    size = raw.size
    whole = size - size % 8
    padded = np.zeros(8, dtype=np.uint8)
    padded[: size - whole] = raw[whole:]
    words = (
        raw[:whole].view(np.int64)
        if raw.ctypes.data % 8 == 0
        else raw[:whole].copy().view(np.int64)
    )
    rows = words.size // _SUM_COLUMNS
    body = words[: rows * _SUM_COLUMNS].reshape(rows, _SUM_COLUMNS)
    rest = words[rows * _SUM_COLUMNS :]
    if whole < size:
        rest = np.concatenate([rest, padded.view(np.int64)])
    with np.errstate(over="ignore"):  # int64 arithmetic wraps, as on the devices
        row_sums = body.sum(axis=1, dtype=np.int64)
        total = row_sums.sum(dtype=np.int64) + rest.sum(dtype=np.int64)
        by_row = (row_sums * np.arange(1, rows + 1, dtype=np.int64)).sum(dtype=np.int64) + rest.sum(
            dtype=np.int64
        ) * np.int64(rows + 1)
        by_column = (
            body.sum(axis=0, dtype=np.int64) * np.arange(1, _SUM_COLUMNS + 1, dtype=np.int64)
        ).sum(dtype=np.int64) + (rest * np.arange(1, rest.size + 1, dtype=np.int64)).sum(
            dtype=np.int64
        )
        mixed = (
            total * np.int64(_MIX[0]) + by_row * np.int64(_MIX[1]) + by_column * np.int64(_MIX[2])
        )
        return int(mixed + np.int64(size))


def read_checksums(sums: Sequence[Checksum]) -> list[int]:
    """Checksums queued with ``checksum_of`` (and any already read, as ints), as ints."""
    return read_values(sums)


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes (bit-exact; NaN payloads included)."""
    data = byte_view(tensor.detach().to("cpu").contiguous())
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(data.numpy().data)
    return digest.hexdigest()


def state_dict_digests(state_dict: Mapping[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_digest(tensor) for name, tensor in state_dict.items()}
