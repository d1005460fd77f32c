"""Loading the fused kernels (``weight_sync.delta.kernels``) without making anyone wait for them.

Importing the kernels imports numba and compiles them, or loads them from numba's cache: 1-3 s
of one core, and ~100 MB, that a push should not pay and a process that never sees a delta
should not pay at all. So each user of the kernels -- a trainer's ``Baseline``, a worker's
receive path once its first delta arrives -- starts the import on a thread of its own and takes
the kernels once they are there: until then it does the same work the NumPy/torch way, to the
same bytes.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from types import ModuleType

logger = logging.getLogger(__name__)


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
        ``wanted=True``, waits for them and raises what stopped them loading."""
        if self._wanted:
            kernels = self._loaded.result()
            assert kernels is not None
            return kernels
        if not self._loaded.done() or self._loaded.exception() is not None:
            return None
        return self._loaded.result()

    def _load(self) -> None:
        try:
            from weight_sync.delta import kernels
        except Exception as exc:  # numba missing, or unable to compile here
            logger.info("fused delta kernels unavailable (%s): comparing in NumPy", exc)
            self._loaded.set_exception(exc)
        else:
            self._loaded.set_result(kernels)
