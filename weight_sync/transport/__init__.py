"""The data plane: a narrow ``Transport`` protocol and its torch.distributed implementation.

Knows nothing of Ray: membership arrives as a ``GroupSpec``; everything here runs in plain
processes, which is how the tests exercise it.
"""

from weight_sync.transport.base import Transport, Work
from weight_sync.transport.rendezvous import address_of_interface, bind_listener
from weight_sync.transport.torch_group import TorchGroup

__all__ = ["TorchGroup", "Transport", "Work", "address_of_interface", "bind_listener"]
