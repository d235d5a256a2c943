"""Which network interface gloo should use when the host name points at loopback.

gloo finds this rank's address by resolving the machine's host name. On many machines (Debian's
/etc/hosts, containers, simulated nodes) that name resolves to 127.0.x.x, so every rank tells its
peers "reach me at 127.0.0.1": fine on one node, and on two nodes every connection across them
is refused after the timeout ("Gloo connectFullMesh failed ... remote=[127.0.0.1]"). The usual
cure is GLOO_SOCKET_IFNAME; when the user has not set it and the job spans nodes, the interface
whose address this host uses to reach MASTER_ADDR is the one the other nodes can reach too.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from typing import Mapping

_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface


def resolves_to_loopback(hostname: str) -> bool:
    """True when `hostname` resolves only to loopback addresses (or not at all)."""
    try:
        infos = socket.getaddrinfo(hostname, None, socket.AF_INET)
    except OSError:
        return True
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def local_address_toward(addr: str) -> str | None:
    """The local IPv4 address the kernel would send from to reach `addr` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # a UDP connect only picks a route
            return str(s.getsockname()[0])
    except OSError:
        return None


def interface_with_address(address: str) -> str | None:
    """The name of the interface holding IPv4 `address`, or None."""
    try:
        import fcntl
    except ImportError:  # not a Unix: leave gloo's own choice
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # an interface without an IPv4 address
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def gloo_interface(environ: Mapping[str, str], world_size: int, local_world_size: int,
                   master_addr: str, hostname: str) -> str | None:
    """The interface to name in GLOO_SOCKET_IFNAME, or None to leave gloo's own choice."""
    if "GLOO_SOCKET_IFNAME" in environ or world_size <= local_world_size:
        return None  # the user chose, or every rank is on this node (loopback works)
    if not resolves_to_loopback(hostname):
        return None
    local = local_address_toward(master_addr)
    if local is None or ipaddress.ip_address(local).is_loopback:
        return None
    return interface_with_address(local)
