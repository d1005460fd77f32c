"""Moved to ``weight_sync.torchrun``: this path keeps working, with a DeprecationWarning, until 0.2."""

from weight_sync._moved import forward

__getattr__ = forward("weight_sync.launch", "weight_sync.torchrun")
