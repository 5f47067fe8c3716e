"""Several machines: the settings of torch's c10d rendezvous for one node of a multi-node run.

``shardwise train --parallel.nnodes N --parallel.rdzv_endpoint HOST:PORT --run.dir SHARED_DIR`` is run
once on every node (as ``torchrun --nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT`` would be,
TorchElastic, https://pytorch.org/docs/stable/elastic/run.html); the node whose address is HOST hosts
the rendezvous store, the others join it, and the agent numbers the nodes and ranks. What this module
works out so that the same command works on a real cluster and in network namespaces on one machine:

* this node's address: the source address the kernel picks to reach HOST (a UDP ``connect`` sends
  nothing). It is the address the agent advertises for the workers (``local_addr``) and decides
  whether this node hosts the store (``is_host``) -- torch's own guess compares host names, which all
  namespaces of one machine share;
* the network interface holding that address, for gloo (``GLOO_SOCKET_IFNAME``, gloo's documented
  setting): without it gloo binds to whatever the host name resolves to, which in a namespace or on a
  node with several NICs may be unreachable from the other nodes. An interface set by the user wins.
"""

from __future__ import annotations

import fcntl
import hashlib
import socket
import struct
from dataclasses import dataclass

from shardwise.config import ConfigError

_SIOCGIFADDR = 0x8915  # linux/sockios.h: get an interface's IPv4 address


@dataclass(frozen=True)
class NodeSettings:
    """What this node passes to the elastic agent."""

    endpoint: str
    host: str
    port: int
    local_addr: str
    is_host: bool
    ifname: str | None
    run_id: str


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), or ConfigError naming parallel.rdzv_endpoint."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"parallel.rdzv_endpoint={endpoint!r} is not HOST:PORT (e.g. node0:29400); "
                          "give the address of one node, the same on every node")
    return host, int(port)


def source_address(host: str, port: int) -> str:
    """The local address the kernel uses to reach ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), port))
            return s.getsockname()[0]
    except OSError as e:
        raise ConfigError(f"parallel.rdzv_endpoint={host}:{port} cannot be reached from this node: {e}") from e


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 ``address`` (Linux), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def node_settings(endpoint: str, run_dir: str) -> NodeSettings:
    """The rendezvous settings of this node. The run id (which must be the same on every node) is derived
    from the endpoint and the run directory, both of which every node is given alike."""
    host, port = split_endpoint(endpoint)
    local = source_address(host, port)
    try:
        host_ip = socket.gethostbyname(host)
    except OSError as e:
        raise ConfigError(f"parallel.rdzv_endpoint={endpoint!r}: cannot resolve {host!r}: {e}") from e
    run_id = "shardwise-" + hashlib.sha1(f"{endpoint}|{run_dir}".encode()).hexdigest()[:12]
    return NodeSettings(endpoint, host, port, local, local == host_ip, interface_of(local), run_id)
