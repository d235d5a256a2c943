"""A simulated cluster on one Linux machine: N "nodes" as network namespaces on one private switch.

Each node is a network namespace with its own loopback and one interface, ``eth0``, holding
``10.<subnet>.0.<i+1>/24``; the other end of each node's veth pair sits in a switch namespace and
is attached to a bridge there, so nothing is added to the machine's own namespace and no packet
can leave it. With ``rate`` (tc's syntax, e.g. ``"1gbit"``) a ``tbf`` qdisc caps both directions
of every node's link: traffic between ranks of one node stays on its loopback at full speed,
traffic between nodes crosses the capped links, as on a cluster whose nodes talk over a slower
network than their ranks do. `interface_bytes` reads the kernel's counters of a node's link, so a
test can check what really crossed it.

With ``hostnames=True`` every node also gets a host name of its own that every node resolves to
its address (an /etc/netns/<node>/hosts file, which ``ip netns exec`` mounts over /etc/hosts, and a
UTS namespace per started process): libraries that advertise ``socket.gethostname()`` to their
peers (torchft's manager and checkpoint servers) then advertise an address the other nodes reach,
as on a real cluster, instead of the machine's one name for loopback.

Needs root and iproute2 (`ip`, `tc`); `unavailable_reason()` says why not, for a skip. Used as a
context manager: every namespace (and so every veth, bridge and qdisc) and every process started
with `start` is removed on exit, also after a failure or a timeout.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
from typing import Sequence


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (not root, no iproute2, no netns support), or None."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2's `ip` and `tc` are not installed"
    probe = f"skprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


class SimCluster:
    """`nodes` namespaces on a private bridge; `rate` caps every node's link (None: uncapped)."""

    _made = itertools.count()

    def __init__(self, nodes: int, rate: str | None = None, subnet: int | None = None,
                 hostnames: bool = False) -> None:
        serial = next(self._made)
        self.tag = f"sk{os.getpid() % 100000}{chr(97 + serial % 26)}"
        # A /24 of 10.0.0.0/8 per cluster, so two clusters or test runs never share addresses.
        self.subnet = subnet if subnet is not None else 100 + (os.getpid() + serial) % 150
        self.names = [f"{self.tag}n{i}" for i in range(nodes)]
        self.switch = f"{self.tag}sw"
        self.rate = rate
        self.hostnames = hostnames
        self._procs: list[subprocess.Popen] = []

    def address(self, node: int) -> str:
        """The IPv4 address of `node`'s eth0."""
        return f"10.{self.subnet}.0.{node + 1}"

    def __enter__(self) -> "SimCluster":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        if self.hostnames:
            table = "127.0.0.1 localhost\n" + "".join(
                f"{self.address(i)} {name}\n" for i, name in enumerate(self.names))
            for name in self.names:
                os.makedirs(f"/etc/netns/{name}", exist_ok=True)
                with open(f"/etc/netns/{name}/hosts", "w") as f:
                    f.write(table)
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            _ip("link", "set", "lo", "up", netns=ns)
            outer = f"{self.tag}v{i}"
            # Made inside the node, then its peer moved to the switch: no name in the host's namespace.
            _ip("link", "add", "eth0", "type", "veth", "peer", "name", outer, netns=ns)
            _ip("link", "set", outer, "netns", self.switch, netns=ns)
            _ip("addr", "add", f"{self.address(i)}/24", "dev", "eth0", netns=ns)
            _ip("link", "set", "eth0", "up", netns=ns)
            _ip("link", "set", outer, "master", "br0", netns=self.switch)
            _ip("link", "set", outer, "up", netns=self.switch)
            if self.rate:
                for where, dev in ((ns, "eth0"), (self.switch, outer)):
                    done = subprocess.run(
                        ["ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root",
                         "tbf", "rate", self.rate, "burst", "256kb", "latency", "100ms"],
                        capture_output=True, text=True)
                    if done.returncode != 0:
                        raise RuntimeError(f"tc tbf on {dev}: {done.stderr.strip()}")

    def start(self, node: int, argv: Sequence[str], **popen: object) -> subprocess.Popen:
        """Start `argv` inside `node` (its own process group, so close() ends all it started)."""
        prefix = ["ip", "netns", "exec", self.names[node]]
        if self.hostnames:
            prefix += ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                       self.names[node]]
        proc = subprocess.Popen([*prefix, *argv],
                                start_new_session=True, **popen)  # type: ignore[call-overload]
        self._procs.append(proc)
        return proc

    def interface_bytes(self, node: int) -> dict[str, int]:
        """The kernel's byte counters of `node`'s eth0: {"tx": sent, "rx": received}."""
        out = {}
        for key, name in (("tx", "tx_bytes"), ("rx", "rx_bytes")):
            done = subprocess.run(["ip", "netns", "exec", self.names[node], "cat",
                                   f"/sys/class/net/eth0/statistics/{name}"],
                                  capture_output=True, text=True, check=True)
            out[key] = int(done.stdout)
        return out

    def close(self) -> None:
        """Kill what was started and delete every namespace (veths, bridge, qdiscs go with them)."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        for ns in [*self.names, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self.hostnames:
            for name in self.names:
                shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)
