"""Moved to ``weight_sync.ray_job``: this path (and ``python -m weight_sync.job``) keeps working,
with a DeprecationWarning, until 0.2."""

import sys

from weight_sync._moved import forward, warn_moved

__getattr__ = forward("weight_sync.job", "weight_sync.ray_job")

if __name__ == "__main__":
    warn_moved("weight_sync.job", "weight_sync.ray_job", stacklevel=2)
    from weight_sync.ray_job import main

    sys.exit(main())
