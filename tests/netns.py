"""Two test hosts on one machine: network namespaces joined by a veth pair, made and removed by the fixture
(skipped with the reason where the machine forbids namespaces), and a helper to start a process in one. A test
that may run beside another one on namespaces passes Hosts of its own (other names and subnet)."""
import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Hosts:
    namespaces: tuple[str, str]
    links: tuple[str, str]
    addrs: tuple[str, str]


PAIR = Hosts(("pm-node0", "pm-node1"), ("pm-veth0", "pm-veth1"), ("10.213.7.1", "10.213.7.2"))
NAMESPACES, LINKS, ADDRS = PAIR.namespaces, PAIR.links, PAIR.addrs


def ip(*args: str):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts(hosts: Hosts = PAIR):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip")
    try:
        for ns in hosts.namespaces:
            ip("netns", "add", ns)
    except subprocess.CalledProcessError as error:
        pytest.skip(f"this machine does not allow network namespaces: {error.stderr.strip()}")
    try:
        ip("link", "add", hosts.links[0], "netns", hosts.namespaces[0], "type", "veth", "peer", "name",
           hosts.links[1], "netns", hosts.namespaces[1])
        for ns, link, addr in zip(hosts.namespaces, hosts.links, hosts.addrs):
            for args in (("addr", "add", f"{addr}/24", "dev", link), ("link", "set", link, "up"),
                         ("link", "set", "lo", "up")):
                ip("netns", "exec", ns, "ip", *args)
        yield
    finally:
        for ns in hosts.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def in_namespace(index: int, argv: list[str], hosts: Hosts = PAIR, **popen) -> subprocess.Popen:
    """gloo and UCX (NIXL) over the veth only: UCX's shared-memory transports would cross namespaces."""
    link = hosts.links[index]
    env = os.environ | {"GLOO_SOCKET_IFNAME": link, "UCX_TLS": "tcp", "UCX_NET_DEVICES": link}
    return subprocess.Popen(["ip", "netns", "exec", hosts.namespaces[index], *argv], env=env, text=True, **popen)
