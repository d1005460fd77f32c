"""Moved to ``weight_sync.send.checks``: this path keeps working, with a DeprecationWarning, until
0.2."""

from weight_sync._moved import forward as _forward

__getattr__ = _forward("weight_sync.entries", "weight_sync.send.checks")
