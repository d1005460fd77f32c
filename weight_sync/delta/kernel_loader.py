"""Loading the fused kernels (``weight_sync.delta.kernels``) without making anyone wait for them.

Importing the kernels imports numba and compiles them, or loads them from numba's cache: 1-3 s
of one core, and ~100 MB, that a push should not pay. So a trainer's ``Baseline`` starts the
import on a thread of its own and takes the kernels once they are there: until then it does the
same work the NumPy way, to the same bytes.

Loaded, the kernels are checked against torch's own fp32 -> bf16 cast on the values that round
in every way and on random bits: they reproduce its rounding formula, which is what torch's x86
code computes (checked bit for bit there); where a platform's torch converted otherwise, deltas
would carry other bits than dense pushes, so the kernels are refused instead.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from types import ModuleType

import numpy as np
import torch

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0  # how long ``wanted=True`` waits for the kernels to load
# fp32 bits that round every way: +-0, +-inf, the largest finite (up to inf), ties to even
# (down and up), either side of a tie, subnormals and ties among them.
_EDGES = [
    0x00000000,
    0x80000000,
    0x7F800000,
    0xFF800000,
    0x7F7FFFFF,
    0x3F808000,
    0xBF808000,
    0x3F818000,
    0x3F807FFF,
    0x3F808001,
    0x00000001,
    0x007FFFFF,
    0x00008000,
    0x00018000,
]


class FusedKernels:
    """The kernels module, loading on a thread started here. ``wanted``: None -- use them once
    loaded; True -- wait for them (and fail where they cannot load); False -- never load them."""

    def __init__(self, wanted: bool | None = None) -> None:
        self._wanted = wanted
        self._loaded: Future[ModuleType | None] = Future()
        if wanted is False:
            self._loaded.set_result(None)
        else:
            threading.Thread(target=self._load, name="weight-sync-kernels", daemon=True).start()

    def get(self) -> ModuleType | None:
        """The kernels; None where they are not loaded (yet, or cannot be). With
        ``wanted=True``, waits for them (at most ``LOAD_TIMEOUT_S``) and raises what stopped
        them loading."""
        if self._wanted:
            kernels = self._loaded.result(timeout=LOAD_TIMEOUT_S)
            assert kernels is not None
            return kernels
        if not self._loaded.done() or self._loaded.exception() is not None:
            return None
        return self._loaded.result()

    def _load(self) -> None:
        try:
            from weight_sync.delta import kernels

            _check(kernels)
        except BaseException as exc:  # numba missing, unable to compile here, or rounding apart
            logger.info("fused delta kernels unavailable (%s): comparing in NumPy", exc)
            self._loaded.set_exception(exc)
        else:
            self._loaded.set_result(kernels)


def _check(kernels: ModuleType) -> None:
    """Raise ``RuntimeError`` unless ``kernels.scan`` rounds as torch casts, here."""
    bits = np.random.default_rng(0).integers(0, 1 << 32, 4096, dtype=np.uint64).astype(np.uint32)
    bits[(bits & 0x7FFFFFFF) > 0x7F800000] &= 0xFF7FFFFF  # no NaN: the kernels leave those alone
    bits[: len(_EDGES)] = _EDGES
    torch_bits = torch.from_numpy(bits.view(np.float32)).to(torch.bfloat16)
    base = torch_bits.view(torch.int16).numpy().view(np.uint16) ^ np.uint16(1)
    values, rows = np.empty(bits.size, np.uint16), np.empty(bits.size, np.int32)
    counts = np.empty(1, np.int64)
    found = kernels.scan(bits, base, values, rows, counts, bits.size, 0)
    if found != bits.size or not np.array_equal(values, base ^ np.uint16(1)):
        raise RuntimeError("the fused kernels round fp32 to bf16 otherwise than torch does here")
