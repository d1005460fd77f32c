"""Delta pushes: what changed since the base every member holds, found, encoded and patched in.

Pure layout and choice (``layout``, ``choice``, ``lineage``), the trainer's copy of the members'
weights (``baseline``), the encoding (``codec``, ``kernels`` and ``kernel_loader`` for the fused
numba compare) and the transfer on both sides (``transfer``). The push reaches this package
through one seam, ``weight_sync.send.wire``; nothing here imports the push.
"""
