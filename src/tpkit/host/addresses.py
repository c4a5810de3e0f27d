"""Which Host headers a local HTTP server accepts (DNS rebinding), pure Python: shared by
the quiz's web tutor and `tpkit serve`.

    allowed_hosts("127.0.0.1")   -> {"127.0.0.1", "localhost", "::1"}
    allowed_hosts("0.0.0.0")     -> None (any: the server was asked to listen everywhere)
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (127.0.0.0/8, ::1)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str) -> set[str] | None:
    """Host-header names accepted when serving on `host`; None: any (wildcard address)."""
    if host in ("0.0.0.0", "::", ""):
        return None
    return {host, "127.0.0.1", "localhost", "::1"} if is_loopback(host) else {host}


def host_of(header: str) -> str:
    """'127.0.0.1:8765' -> '127.0.0.1'; '[::1]:80' -> '::1'."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header
