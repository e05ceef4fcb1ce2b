"""Two test hosts on one machine: network namespaces joined by a veth pair, made and removed by the fixture
(skipped with the reason where the machine forbids namespaces), and a helper to start a process in one."""
import contextlib
import os
import shutil
import subprocess

import pytest

NAMESPACES, LINKS, ADDRS = ("pm-node0", "pm-node1"), ("pm-veth0", "pm-veth1"), ("10.213.7.1", "10.213.7.2")


def ip(*args: str):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2's ip")
    try:
        for ns in NAMESPACES:
            ip("netns", "add", ns)
    except subprocess.CalledProcessError as error:
        pytest.skip(f"this machine does not allow network namespaces: {error.stderr.strip()}")
    try:
        ip("link", "add", LINKS[0], "netns", NAMESPACES[0], "type", "veth", "peer", "name", LINKS[1], "netns",
           NAMESPACES[1])
        for ns, link, addr in zip(NAMESPACES, LINKS, ADDRS):
            for args in (("addr", "add", f"{addr}/24", "dev", link), ("link", "set", link, "up"),
                         ("link", "set", "lo", "up")):
                ip("netns", "exec", ns, "ip", *args)
        yield
    finally:
        for ns in NAMESPACES:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def in_namespace(index: int, argv: list[str], **popen) -> subprocess.Popen:
    env = os.environ | {"GLOO_SOCKET_IFNAME": LINKS[index]}
    return subprocess.Popen(["ip", "netns", "exec", NAMESPACES[index], *argv], env=env, text=True, **popen)
