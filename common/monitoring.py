"""A read-only HTTP endpoint for operators: Prometheus's /metrics, and whatever pages its owner adds.

The coordinator (server/monitor) and a client process (`fedsaddle client --monitor`) each
serve one. It runs in threads of its own and never in the event loop or the driver's
thread: what it shows is read from values the run keeps anyway, and a viewer that is
slow or hostile costs its own thread, never a round.

What it grants a peer is bounded: `max_connections` connections at once (more are
closed at accept), a request must arrive within `request_timeout_s`, a write that a
viewer does not take in `write_timeout_s` ends its connection, and a long-lived stream
(server-sent events) is one of at most `max_streams`. It answers GET and HEAD alone.

It binds 127.0.0.1 unless told otherwise; bound to any other address it requires TLS and
a viewer token of its own (`check_exposure`), sent as `Authorization: Bearer TOKEN`
(Prometheus's `authorization.credentials_file`) or, for a browser, once as `?token=`,
which sets a cookie and redirects to the same page without it.
"""

from __future__ import annotations

import hmac
import http.server
import ipaddress
import logging
import secrets
import socket
import socketserver
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("fedsaddle.monitor")

COOKIE = "fedsaddle_monitor"
STREAM_BUFFER_BYTES = 64 << 10  # the kernel's send buffer for a stream: what a viewer that stops reading holds


class MonitorError(ValueError):
    """The monitor cannot serve as asked: the message names the setting and the problem."""


@dataclass(frozen=True)
class Exposure:
    """Where the monitor listens and what a viewer must show: TLS files and a token (both None on loopback)."""

    listen: str
    cert: str | None = None
    key: str | None = None
    token_file: str | None = None


def split_address(listen: str, what: str = "monitor") -> tuple[str, int]:
    """HOST:PORT (or [v6]:PORT) as (host, port); MonitorError naming `what` if it is not one."""
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise MonitorError(f"{what}: must be HOST:PORT with a port from 0 to 65535, got {listen!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(exposure: Exposure, what: str = "monitor") -> str | None:
    """The viewer token `exposure` requires (None on loopback without one); MonitorError when an address
    other than loopback lacks TLS or a token, or a file cannot be read."""
    host, _ = split_address(exposure.listen, what)
    if (exposure.cert is None) != (exposure.key is None):
        raise MonitorError(f"{what}: TLS needs both a certificate and its key")
    if not is_loopback(host) and (exposure.cert is None or exposure.token_file is None):
        raise MonitorError(
            f"{what}: {exposure.listen} is not a loopback address, so the monitor needs TLS (a certificate and "
            "its key) and a viewer token file; bind 127.0.0.1 (and reach it through an SSH tunnel), or give them"
        )
    for path in (exposure.cert, exposure.key):
        if path is not None and not Path(path).is_file():
            raise MonitorError(f"{what}: {path} is not a readable file")
    if exposure.token_file is None:
        return None
    try:
        token = Path(exposure.token_file).read_text().strip()
    except OSError as exc:
        raise MonitorError(f"{what}: the viewer token file {exposure.token_file}: {exc.strerror or exc}") from None
    if len(token) < 16:
        raise MonitorError(
            f"{what}: the viewer token in {exposure.token_file} has {len(token)} characters; use at least 16 "
            "(`fedsaddle new-token` or `openssl rand -hex 32` makes one)"
        )
    return token


@dataclass
class Reply:
    """What a route answers: a status, a content type and a body (bytes)."""

    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    status: int = 200


Route = Callable[[], Reply]
# A long-lived route: called with a `write` that sends bytes (raising OSError once the viewer is gone
# or too slow) and a `stopping` event; returns when the stream is over.
StreamRoute = Callable[[Callable[[bytes], None], threading.Event], None]


class MonitorServer:
    """The endpoint: `routes` (path -> Route), `streams` (path -> StreamRoute), served until `close`."""

    def __init__(
        self,
        exposure: Exposure,
        routes: dict[str, Route],
        streams: dict[str, StreamRoute] | None = None,
        *,
        max_connections: int = 32,
        max_streams: int = 8,
        request_timeout_s: float = 5.0,
        write_timeout_s: float = 5.0,
        what: str = "monitor",
    ) -> None:
        self.token = check_exposure(exposure, what)
        self.routes, self.streams = routes, streams or {}
        self.max_connections, self.max_streams = max_connections, max_streams
        self.request_timeout_s, self.write_timeout_s = request_timeout_s, write_timeout_s
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self.connections = 0  # open now
        self.viewers = 0  # streams open now
        self.refused = {"connections": 0, "streams": 0, "unauthorized": 0}  # turned away, by why
        self.context: ssl.SSLContext | None = None
        if exposure.cert is not None and exposure.key is not None:
            self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.context.minimum_version = ssl.TLSVersion.TLSv1_2
            try:
                self.context.load_cert_chain(exposure.cert, exposure.key)
            except (ssl.SSLError, OSError) as exc:
                raise MonitorError(f"{what}: cannot load its TLS certificate {exposure.cert}: {exc}") from None
        host, port = split_address(exposure.listen, what)
        try:
            self.server = _Server((host, port), _handler_for(self), self)
        except OSError as exc:
            raise MonitorError(f"{what}: cannot listen on {exposure.listen}: {exc.strerror or exc}") from None
        self.port = int(self.server.server_address[1])
        self.address = f"{host}:{self.port}"
        self.scheme = "https" if self.context else "http"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fedsaddle-monitor", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, end the streams, and wait (briefly) for the serving thread."""
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def authorized(self, headers: Any, query: dict[str, list[str]]) -> tuple[bool, bool]:
        """(may see it, came with the token in its query): on loopback without a token, everyone may."""
        if self.token is None:
            return True, False
        given = headers.get("Authorization", "")
        if given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip().encode(), self.token.encode()):
            return True, False
        for part in headers.get("Cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE and hmac.compare_digest(value.encode(), self.token.encode()):
                return True, False
        in_query = query.get("token", [""])[0]
        if in_query and hmac.compare_digest(in_query.encode(), self.token.encode()):
            return True, True
        return False, False

    def admit(self) -> bool:
        with self._lock:
            if self.connections >= self.max_connections:
                self.refused["connections"] += 1
                return False
            self.connections += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.connections -= 1

    def open_stream(self) -> bool:
        with self._lock:
            if self.viewers >= self.max_streams:
                self.refused["streams"] += 1
                return False
            self.viewers += 1
            return True

    def close_stream(self) -> None:
        with self._lock:
            self.viewers -= 1


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = False  # an address in use is an error, not shared
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], handler: type[http.server.BaseHTTPRequestHandler], owner: Any) -> None:
        self.owner: MonitorServer = owner
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Bounded before a thread is started for it: a flood of connections costs an accept and a close each.
        if not self.owner.admit():
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self.owner.leave()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            request.settimeout(self.owner.request_timeout_s)
            if self.owner.context is not None:  # the handshake in this connection's thread, never in accept's
                request = self.owner.context.wrap_socket(request, server_side=True)
            super().process_request_thread(request, client_address)
        except (OSError, ssl.SSLError):
            self.shutdown_request(request)
        finally:
            self.owner.leave()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("monitor: a connection from %s failed", client_address, exc_info=True)


def _handler_for(owner: MonitorServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "fedsaddle-monitor"
        sys_version = ""
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("monitor: %s %s", self.address_string(), format % args)

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def do_GET(self) -> None:
            self._serve(head=False)

        def _refuse_method(self) -> None:
            self._reply(Reply(b"read-only: GET and HEAD only\n", status=405), extra={"Allow": "GET, HEAD"})

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method

        def _serve(self, head: bool) -> None:
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            allowed, by_query = owner.authorized(self.headers, query)
            if not allowed:
                with owner._lock:
                    owner.refused["unauthorized"] += 1
                self._reply(
                    Reply(
                        b"a viewer token is required: Authorization: Bearer TOKEN, or ?token=TOKEN once\n", status=401
                    ),
                    extra={"WWW-Authenticate": 'Bearer realm="fedsaddle-monitor"'},
                )
                return
            if by_query:  # the token leaves the address bar (and the history): a cookie carries it from now on
                secure = "; Secure" if owner.context is not None else ""
                self._reply(
                    Reply(b"", status=303),
                    extra={
                        "Location": url.path or "/",
                        "Set-Cookie": f"{COOKIE}={owner.token}; Path=/; HttpOnly; SameSite=Strict{secure}",
                    },
                )
                return
            stream = owner.streams.get(url.path)
            if stream is not None and not head:
                self._stream(stream)
                return
            route = owner.routes.get(url.path)
            if route is None:
                self._reply(Reply(b"not found\n", status=404))
                return
            try:
                reply = route()
            except Exception:
                log.exception("monitor: %s failed", url.path)
                reply = Reply(b"internal error\n", status=500)
            self._reply(reply, head=head)

        def _reply(self, reply: Reply, head: bool = False, extra: dict[str, str] | None = None) -> None:
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
            self.send_header("Cache-Control", "no-store")
            for name, value in _security_headers():
                self.send_header(name, value)
            for name, value in (extra or {}).items():
                self.send_header(name, value)
            self.end_headers()
            if not head:
                self.wfile.write(reply.body)

        def _stream(self, stream: StreamRoute) -> None:
            if not owner.open_stream():
                self._reply(Reply(b"too many viewers\n", status=503), extra={"Retry-After": "10"})
                self.close_connection = True
                return
            try:
                # A viewer that does not read is let go once a small buffer is full and a write waits this long.
                self.connection.settimeout(owner.write_timeout_s)
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_BUFFER_BYTES)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-store")
                for name, value in _security_headers():
                    self.send_header(name, value)
                self.end_headers()
                self.close_connection = True

                def write(data: bytes) -> None:
                    self.wfile.write(data)
                    self.wfile.flush()

                stream(write, owner.stopping)
            except (OSError, ValueError):
                pass  # the viewer left, or stopped reading for write_timeout_s
            finally:
                owner.close_stream()

    return Handler


def _security_headers() -> Iterator[tuple[str, str]]:
    """The page's own files only: no script, style or connection from elsewhere, never in a frame."""
    yield (
        "Content-Security-Policy",
        "default-src 'self'; img-src 'self' data:; object-src 'none'; frame-ancestors 'none'; base-uri 'none'",
    )
    yield "X-Content-Type-Options", "nosniff"
    yield "Referrer-Policy", "no-referrer"


def new_token() -> str:
    """A viewer token: 32 random bytes, hex."""
    return secrets.token_hex(32)
