"""Which Host headers a local HTTP server accepts (DNS rebinding), pure Python: shared by
the quiz's web tutor and `tpkit serve` (through `tpkit.host.web`).

    allowed_hosts("127.0.0.1")   -> {"127.0.0.1", "localhost", "::1"}
    allowed_hosts("0.0.0.0")     -> this machine's names and addresses (`machine_names`)
    allowed_hosts("10.0.0.5", ["llm.lan"]) -> {"10.0.0.5", "llm.lan"}

A wildcard address still has an allowlist: a page of another site that got its name
resolved to this machine (DNS rebinding) sends its own name as the Host, not one of
this machine's.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Iterable
from pathlib import Path

WILDCARDS = ("0.0.0.0", "::", "")
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1"}
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str, extra: Iterable[str] = ()) -> set[str]:
    """Host-header names (lower case) accepted when serving on `host`, plus `extra`
    (--allowed-host): the loopback names with a loopback address, this machine's names
    and addresses with a wildcard one."""
    if host in WILDCARDS:
        names = machine_names()
    else:
        names = {host} | (LOOPBACK_NAMES if is_loopback(host) else set())
    return {_norm(n) for n in (*names, *extra)}


def machine_names() -> set[str]:
    """This machine's host name, fully qualified name, interface addresses (IPv4 and
    IPv6, Linux), and the loopback names."""
    names = set(LOOPBACK_NAMES)
    for name in {socket.gethostname(), socket.getfqdn()}:
        names.add(name)
        with contextlib.suppress(OSError):
            names |= {str(a[4][0]) for a in socket.getaddrinfo(name, None)}
    return names | _interface_addresses()


def _ipv4_interfaces() -> dict[str, str]:
    """{interface name: its IPv4 address} (Linux; the ones without an address left out)."""
    out = {}
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                req = struct.pack("256s", name.encode()[:15])
                out[name] = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
    return out


def interface_reaching(host: str) -> str | None:
    """The name of this machine's interface whose address is the source of packets to
    `host` (an IPv4 address or name), None if unknown. On `host` itself: the interface
    that carries its address, not loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP: chooses the route, sends nothing
            source = s.getsockname()[0]
    except OSError:
        return None
    return next((n for n, a in _ipv4_interfaces().items() if a == source), None)


def _interface_addresses() -> set[str]:
    out = set(_ipv4_interfaces().values())
    with contextlib.suppress(OSError, ValueError):  # hex address, index, prefix, ..., name
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            out.add(str(ipaddress.IPv6Address(int(line.split()[0], 16))))
    return out


def host_of(header: str) -> str:
    """'127.0.0.1:8765' -> '127.0.0.1'; '[::1]:80' -> '::1'."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _norm(name: str) -> str:
    name = host_of(name.strip()) if name.startswith("[") else name.strip()
    try:
        return str(ipaddress.ip_address(name.split("%", 1)[0]))
    except ValueError:
        return name.lower().rstrip(".")


def host_allowed(header: str, allowed: set[str]) -> bool:
    """Does a Host header name one of `allowed` (as `allowed_hosts` writes them)?"""
    return bool(header) and _norm(host_of(header)) in allowed
