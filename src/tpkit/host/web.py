"""What the local HTTP servers (the quiz's web tutor, `tpkit serve`) share: who may ask
(`Guard`), how they listen (`listen`, `Server`), what they say when exposed.

    guard = Guard("0.0.0.0", allowed_hosts=["llm.lan"], allowed_origins=[])
    refusal = guard.refusal("POST", handler.headers)   # None, or (status, message)
    server = listen(lambda: Server.on(host)((host, port), Handler), host, port)

`Guard`'s rule, against a page of another site driving the user's browser:
- the Host header must be one of `tpkit.host.addresses.allowed_hosts` (DNS rebinding:
  the page's own name is not), whatever address the server listens on;
- a POST with an Origin header must come from the server's own origin
  (`http://<Host>`) or one of `allowed_origins` ("*": any);
- a POST must say `Content-Type: application/json`: a browser sends one of those across
  sites only after a preflight this server does not approve, while text/plain, a form
  or no type at all it sends at once ("simple" requests), so those are refused unless
  the Origin is allowed.
"""

from __future__ import annotations

import errno
import socket
import sys
from collections.abc import Callable, Iterable
from http.server import ThreadingHTTPServer
from typing import TypeVar

from tpkit.host.addresses import allowed_hosts, host_allowed, is_loopback
from tpkit.spec.errors import UserError

T = TypeVar("T")
MAX_PORT = 65535
HOST = "127.0.0.1"  # what they listen on unless told: this machine only
ALLOWED_HOST_HELP = ("a Host name clients may use besides the default ones (--host and, "
                     "for 0.0.0.0 or ::, this machine's names and addresses); repeatable")


class Guard:
    """The Host allowlist and the origin rule of one server."""

    def __init__(self, host: str, allowed_hosts_: Iterable[str] = (),
                 allowed_origins: Iterable[str] = ()) -> None:
        self.hosts = allowed_hosts(host, allowed_hosts_)
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}

    def refusal(self, method: str, headers) -> tuple[int, str] | None:
        """(status, message) for a request this server must not answer, else None."""
        host = headers.get("Host") or ""
        if not host_allowed(host, self.hosts):
            return 403, (f"forbidden host {host!r}: this server answers to "
                         f"{', '.join(sorted(self.hosts))} (--allowed-host adds one)")
        if method != "POST":
            return None
        origin = (headers.get("Origin") or "").rstrip("/").lower()
        if origin and not self.origin_allowed(origin) and origin != f"http://{host.lower()}":
            return 403, (f"cross-origin request from {origin} refused (--allow-origin "
                         f"{origin} allows it)")
        ctype = (headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if ctype != "application/json" and not (origin and self.origin_allowed(origin)):
            return 415, (f"Content-Type {ctype or 'missing'}: a POST body must be sent "
                         f"as application/json")
        return None

    def origin_allowed(self, origin: str) -> bool:
        """Is `origin` one of --allow-origin's (a page there may call this server)?"""
        return "*" in self.origins or origin.rstrip("/").lower() in self.origins


class Server(ThreadingHTTPServer):
    """A threading server whose clients may vanish: no traceback for a broken pipe."""

    daemon_threads = True
    request_queue_size = 128  # a burst of connections waits to be accepted, not refused

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            return  # the client went away (broken pipe, reset): nothing to report
        super().handle_error(request, client_address)

    @classmethod
    def on(cls, host: str) -> type[Server]:
        """This class, or its IPv6 variant for an IPv6 `host`."""
        if ":" not in host:
            return cls
        return type(f"{cls.__name__}6", (cls,), {"address_family": socket.AF_INET6})


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0: a free port), for a server built later
    (`Server.on(host)(..., bind_and_activate=False)` takes it as its `socket`)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(Server.request_queue_size)
    except OSError:
        sock.close()
        raise
    return sock


def listen(make: Callable[[], T], host: str, port: int) -> T:
    """`make()` (a server bound to host:port); a port out of range, a busy port or a bad
    address as one UserError line."""
    if not 0 <= port <= MAX_PORT:
        raise UserError(f"--port={port} must be in [0, {MAX_PORT}] (0: any free port)")
    try:
        return make()
    except OSError as e:
        why = (f"port {port} is already in use on {host}; choose another with --port "
               f"(--port 0 picks a free one)" if e.errno == errno.EADDRINUSE
               else f"cannot listen on {host}:{port}: {e.strerror or e}")
        raise UserError(why) from None  # one line from `tpkit.cli`, exit 2


def warn_if_exposed(prog: str, host: str, what: str) -> None:
    """A warning line on stderr when `host` reaches beyond this machine."""
    if not is_loopback(host):
        print(f"{prog}: warning: --host {host} makes {what} reachable from other "
              f"machines (no login, no TLS)", file=sys.stderr)

