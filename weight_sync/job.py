"""Moved to ``weight_sync.ray_job``: this path (and ``python -m weight_sync.job``) keeps working,
with a DeprecationWarning, until 0.2."""

import sys as _sys

from weight_sync._moved import forward as _forward
from weight_sync._moved import warn_moved as _warn_moved

__getattr__ = _forward("weight_sync.job", "weight_sync.ray_job")

if __name__ == "__main__":
    _warn_moved("weight_sync.job", "weight_sync.ray_job", stacklevel=2)
    from weight_sync.ray_job import main

    _sys.exit(main())
