"""Moved to ``weight_sync.checksums``: this path keeps working, with a DeprecationWarning, until
0.2."""

from weight_sync._moved import forward

__getattr__ = forward("weight_sync.verify", "weight_sync.checksums")
