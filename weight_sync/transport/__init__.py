"""The data plane: a narrow ``Transport`` protocol and the ways bytes move behind it.

``TorchGroup`` (torch.distributed: Gloo or NCCL, any host), ``shm`` (the host ring: shared memory
for the workers on the trainer's host), ``cuda_ipc`` (the CUDA ring: the trainer's GPU memory for
the workers on that GPU), both speaking the protocol of ``ring``, ``Fanout`` (the trainer's end
of several at once) and ``Relay`` (a member of the group passing the push on to the others of its
host through a host ring of its own); ``rounds`` (several senders' buckets over one group,
point to point, and the lanes' transports over it: the NCCL design for pushes from many
senders). Knows nothing
of Ray: membership arrives as a
``GroupSpec``; everything here runs in plain processes, which is how the tests exercise it.
"""

from weight_sync.transport import cuda_ipc, ring, rounds, shm
from weight_sync.transport.base import Transport, Work
from weight_sync.transport.fanout import Fanout
from weight_sync.transport.relay import Relay
from weight_sync.transport.rendezvous import address_of_interface, bind_listener, listen_address
from weight_sync.transport.torch_group import TorchGroup

__all__ = [
    "Fanout",
    "Relay",
    "TorchGroup",
    "Transport",
    "Work",
    "address_of_interface",
    "bind_listener",
    "cuda_ipc",
    "listen_address",
    "ring",
    "rounds",
    "shm",
]
