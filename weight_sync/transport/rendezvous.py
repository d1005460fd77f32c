"""Rendezvous: the store every member dials to form the group.

The trainer binds its listening socket itself (port 0, the address from the config) and hands the
open file descriptor to ``TCPStore``. Two things follow: there is no window between picking a
port and listening on it for another process to steal, and the store listens only where we bound
(``TCPStore(host, is_master=True)`` alone listens on every interface).
"""

from __future__ import annotations

import datetime
import fcntl
import ipaddress
import socket
import struct

from torch.distributed import TCPStore

from weight_sync.errors import SyncTimeoutError, TransportError


def bind_listener(address: str) -> socket.socket:
    """A listening TCP socket on ``address`` at a port the kernel picks."""
    try:
        infos = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise TransportError(f"cannot resolve master_addr {address!r}: {exc}") from exc
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(sockaddr)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise TransportError(
            f"cannot listen on {address!r}: {exc}; check that master_addr is an address of "
            "this node"
        ) from exc
    return sock


def open_store(
    address: str, port: int, world_size: int, timeout_s: float, listener: socket.socket | None
) -> TCPStore:
    """The master store (given ``listener``, whose descriptor the store takes over) or a client."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if listener is not None:
            return TCPStore(
                address,
                port,
                world_size,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
                master_listen_fd=listener.detach(),
            )
        return TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    except (RuntimeError, TimeoutError) as exc:
        kind = SyncTimeoutError if "timeout" in str(exc).lower() else TransportError
        where = "listen" if listener is not None else "reach"
        raise kind(
            f"cannot {where} the rendezvous store at {address}:{port} within {timeout_s}s: "
            f"{exc}; {unreachable_hint(address)}"
        ) from exc


def unreachable_hint(address: str) -> str:
    """What to check when a member cannot reach the trainer's store at ``address``. The commonest
    cause across nodes is the default: the trainer listens on loopback, which no other node
    reaches, and the store's own error says only that the connection failed."""
    try:
        loopback = ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name
        loopback = address == "localhost"
    if loopback:
        return (
            f"the trainer listens on loopback ({address}: SyncConfig.master_addr's default), which "
            "only members on the trainer's own node reach. For members on other nodes, name the "
            "network that reaches them: SyncConfig(interface='eth0') (the NIC's name on the "
            "trainer's node; with several senders each rank passes its own) or "
            "SyncConfig(master_addr='<the trainer node's IP>')"
        )
    return (
        "check that the trainer is alive and that this node reaches that address and port (the "
        "trainer listens on SyncConfig.interface's address, else on master_addr)"
    )


def local_address_towards(address: str) -> str:
    """The local IP the kernel would use to reach ``address``: the interface a member's data
    sockets should bind to (loopback for a loopback master, the routed NIC otherwise)."""
    family = socket.getaddrinfo(address, 0)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))  # UDP connect sends nothing; it only picks a route
        return probe.getsockname()[0]


_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface


def address_of_interface(name: str) -> str:
    """The IPv4 address of network interface ``name`` on this node (Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            request = struct.pack("256s", name.encode()[:15])
            reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
        except OSError as exc:
            known = ", ".join(n for _, n in socket.if_nameindex())
            raise TransportError(
                f"interface {name!r} has no IPv4 address on {socket.gethostname()} ({exc}); "
                f"interfaces here: {known}"
            ) from exc
    return socket.inet_ntoa(reply[20:24])


def listen_address(master_addr: str, interface: str | None) -> str:
    """Where a trainer listens for its members: ``interface``'s address when the config names
    one (``SyncConfig.interface``), else ``master_addr`` (loopback unless the user names
    another)."""
    return master_addr if interface is None else address_of_interface(interface)
