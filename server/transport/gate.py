"""The connection gate: closes connections that carry nothing, so that a flood of them cannot keep clients out.

gRPC accepts a TCP connection, completes HTTP/2's preface and SETTINGS, and only then
shows the coordinator a call: a peer that opens thousands of connections and never
calls (or opens a stream and never says Hello) is invisible to the servicer, and gRPC's
own limits are global (`grpc.max_allowed_incoming_connections`), so such a peer would
fill them for everyone. gRPC's `max_connection_idle_ms` does reap them, but only through
a graceful GOAWAY whose PING a peer that never reads never acknowledges: about a minute.

So the gate looks at the process's own sockets (/proc/self/fd, Linux) every
`SWEEP_S`, or less often when a sweep is costly (`sweep_interval`): each connection
accepted on one of the coordinator's ports that carries no call (a session, a stream
admitted to say its Hello, a health check) is *quiet*. A
connection quiet for longer than the handshake deadline is closed; of one address's
quiet connections the newest `max_quiet_per_peer` are kept and the others closed once
quiet for OVER_CAP_GRACE_S (at most OVER_CAP_PER_SWEEP in one sweep, the oldest first). (A
stream that never says Hello ends at hello_timeout_s, and
an address may have max_quiet_per_peer of those: then its connection is quiet.)
Closing is `shutdown(2)` on a duplicate of gRPC's descriptor, checked to be the same
socket first: gRPC sees the end of the stream and releases the connection itself; the
gate never closes gRPC's descriptor.

An address over its cap (a stream of it refused for its quiet cap, or more quiet
connections than the cap at a sweep) is also *held off*: a socket filter on the
listening sockets drops its new connections' SYN (synfilter.py), so that gRPC never
accepts, and allocates for, the thousands a flooder would open; it is lifted once the
address has been over nothing for HOLD_OFF_S and holds no more than its cap.

Where /proc is absent (not Linux) the gate does nothing and gRPC's own limits remain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from grpc_health.v1 import _async as health_aio  # public as grpc_health.v1.health.aio
from grpc_health.v1 import health_pb2

from fedsaddle.common.memory import release_heaps
from fedsaddle.common.text import RefusalLog
from fedsaddle.server.transport import synfilter

log = logging.getLogger("fedsaddle.coordinator")

FEW = 4  # fewer silent connections than this from one address in one sweep are not worth a warning
# Connections closed, or streams refused at once, before the heaps' free pages are handed back (at most once a
# second): each leaves heap pages that its short-lived allocations touched and that live neighbours keep.
TRIM_AFTER = 256
SWEEP_S = 0.25  # how often the gate looks, at most
# A sweep costs about 8 us per descriptor (listing /proc/self/fd alone is half of it): 16 ms at 2000
# connections, 60 ms at 8000. The gate waits long enough between sweeps to take at most this share of
# one core, and sweeps at least every MAX_SWEEP_S.
SWEEP_SHARE = 0.05
MAX_SWEEP_S = 1.0
OVER_CAP_GRACE_S = 3.0  # how long a connection over its address's cap may stay quiet
# Connections over their addresses' caps closed per sweep, at most (the oldest first). A flood opened at once
# would otherwise be closed at once, every OVER_CAP_GRACE_S, and its reopened connections (for a flood of
# streams, each one a call refused) arrive while gRPC still releases the closed ones: at 2000 streams that
# wave took the coordinator's RSS 30 MiB above where it stayed between waves. Spread over sweeps, the closes
# come at a steady rate (about 600 a second with 2000 connections).
OVER_CAP_PER_SWEEP = 256
# An address whose streams were refused for its quiet cap has its new connections dropped in the kernel
# (synfilter.py) until it has been refused nothing for this long and holds no more than its cap.
HOLD_OFF_S = OVER_CAP_GRACE_S
_FDS = "/proc/self/fd"


def sweep_interval(spent: float) -> float:
    """The wait before the next sweep, after one that took `spent` seconds (see SWEEP_SHARE)."""
    return min(MAX_SWEEP_S, max(SWEEP_S, spent / SWEEP_SHARE))


def peer_key(peer: str) -> tuple[str, int] | None:
    """(host, port) of a gRPC peer string ('ipv4:127.0.0.1:5000', 'ipv6:[::1]:5000'); None for others."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6") or ":" not in rest:
        return None
    host, _, port = rest.rpartition(":")
    try:
        return _plain(host.strip("[]")), int(port)
    except ValueError:
        return None


def _plain(host: str) -> str:
    """An IPv4-mapped IPv6 address as the IPv4 address gRPC names it by."""
    return host[7:] if host.startswith("::ffff:") and "." in host else host


@dataclass
class _Connection:
    inode: int
    peer: tuple[str, int]
    quiet_since: float  # when it was first seen, or last carried a call


class ConnectionGate:
    """Tracks the coordinator's accepted connections and closes the quiet ones (see the module's docstring)."""

    def __init__(self, ports: set[int], handshake_timeout_s: float, max_quiet_per_peer: int) -> None:
        self.ports = ports
        self.handshake_timeout_s = handshake_timeout_s
        self.max_quiet_per_peer = max_quiet_per_peer
        self.in_use: Counter[tuple[str, int]] = Counter()  # calls (sessions, health checks) open per connection
        self._released: dict[tuple[str, int], float] = {}  # when a connection's last call ended
        self._connections: dict[int, _Connection] = {}  # by descriptor
        self._other: dict[int, int] = {}  # descriptors that are not our connections: fd -> inode
        self.closed_silent = 0  # connections closed for carrying nothing within the deadline
        self.closed_over_cap = 0  # connections closed for being over one address's quiet cap
        self.refusals = RefusalLog(log)
        self._ended_since_trim, self._trimmed_at = 0, 0.0
        self.enabled = os.path.isdir(_FDS)
        self._listeners: dict[int, int] = {}  # the coordinator's listening sockets: fd -> inode
        self._held_off: dict[str, float] = {}  # addresses whose new connections are dropped: when last refused
        self._filtered: frozenset[str] = frozenset()  # the addresses the listeners' filter drops now
        self.filter_usable = self.enabled  # False once attaching a filter failed (not Linux, or refused)
        self.held_off = 0  # addresses held off so far

    # -- what the servicer says --------------------------------------------------------------

    def enter(self, peer: str) -> None:
        """A call (a session, a stream admitted to say its Hello, a health check) now runs on `peer`'s connection."""
        key = peer_key(peer)
        if key is not None:
            self.in_use[key] += 1

    def refused(self) -> None:
        """A stream was refused at once (admission: a flood's, most likely): its call's memory is freed."""
        self._ended_since_trim += 1

    def hold_off(self, peer: str) -> None:
        """`peer`'s address floods (a stream of it was refused for its quiet cap): drop its new connections in
        the kernel until it is quiet again (synfilter.py). Its connections are closed by the sweeps as before."""
        key = peer_key(peer)
        if key is not None:
            self._hold(key[0], time.monotonic())

    def _hold(self, host: str, now: float) -> None:
        if not self.filter_usable:
            return
        fresh = host not in self._held_off
        self._held_off[host] = now
        if fresh:
            self.held_off += 1
            if not self._listeners:
                self._scan(now)
            self._refilter()
            self.refusals.warn(
                "new connections from %s are dropped for now: it holds more than %d connections that have not "
                "said Hello (a flood?)",
                host,
                self.max_quiet_per_peer,
            )

    def _refilter(self) -> None:
        """Give the listening sockets the filter for the addresses held off now (or none)."""
        wanted = frozenset(self._held_off)
        if wanted == self._filtered:
            return
        ops = synfilter.program(sorted(wanted)) if wanted else None
        for fd, inode in list(self._listeners.items()):
            try:
                duplicate = os.dup(fd)
            except OSError:
                continue
            with socket.socket(fileno=duplicate) as sock:
                try:
                    if os.fstat(duplicate).st_ino != inode:
                        continue
                    if ops is None:
                        synfilter.detach(sock)
                    else:
                        synfilter.attach(sock, ops)
                except OSError as error:
                    log.debug("cannot filter the listening socket: %s; floods are met by the sweeps alone", error)
                    self.filter_usable = False
                    self._held_off.clear()
                    return
        self._filtered = wanted

    def leave(self, peer: str) -> None:
        key = peer_key(peer)
        if key is None or not self.in_use[key]:
            return
        self.in_use[key] -= 1
        if not self.in_use[key]:
            del self.in_use[key]
            self._released[key] = time.monotonic()

    # -- the sweep ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Sweep until cancelled."""
        while self.enabled:
            started = time.monotonic()
            try:
                self.sweep(started)
            except Exception:  # the gate must outlive anything odd in /proc
                log.exception("the connection gate's sweep")
            await asyncio.sleep(sweep_interval(time.monotonic() - started))

    def sweep(self, now: float) -> int:
        """Close the connections that carried nothing too long, or are over their address's cap; how many."""
        if self._ended_since_trim >= TRIM_AFTER and now - self._trimmed_at >= 1.0:
            # gRPC has released what the last sweeps closed (about 17 KiB each) and the streams refused since
            # (a flood's); a flood that reopens them would otherwise keep the freed pages in the heaps until
            # the next periodic trim. A burst of 2000 refused streams left about 15 MiB of them.
            release_heaps()
            self._ended_since_trim, self._trimmed_at = 0, now
        self._scan(now)
        quiet: dict[str, list[tuple[int, _Connection]]] = {}
        closing: list[tuple[int, _Connection, str]] = []
        for fd, connection in self._connections.items():
            if connection.peer in self.in_use:
                connection.quiet_since = now
                continue
            released = self._released.get(connection.peer, 0.0)
            connection.quiet_since = max(connection.quiet_since, released)
            if now - connection.quiet_since > self.handshake_timeout_s:
                closing.append((fd, connection, "silent"))
            else:
                quiet.setdefault(connection.peer[0], []).append((fd, connection))
        if self._held_off:
            for host, refused_at in list(self._held_off.items()):
                if now - refused_at >= HOLD_OFF_S and len(quiet.get(host, ())) <= self.max_quiet_per_peer:
                    del self._held_off[host]
            self._refilter()
        over_cap: list[tuple[int, _Connection]] = []
        for host, listed in quiet.items():
            if len(listed) > self.max_quiet_per_peer:
                self._hold(host, now)
                # The newest are kept; of the rest, those quiet for OVER_CAP_GRACE_S are closed. A flood that
                # reopens every connection closed costs the coordinator (an accept, a handshake, and for a
                # stream a call served in Python) once per grace, not once per sweep.
                listed.sort(key=lambda item: item[1].quiet_since)
                excess = listed[: len(listed) - self.max_quiet_per_peer]
                over_cap.extend((fd, c) for fd, c in excess if now - c.quiet_since >= OVER_CAP_GRACE_S)
        over_cap.sort(key=lambda item: item[1].quiet_since)
        closing.extend((fd, c, "over") for fd, c in over_cap[:OVER_CAP_PER_SWEEP])
        silent: Counter[str] = Counter()
        over: Counter[str] = Counter()
        for fd, connection, why in closing:
            if self._shut(fd, connection.inode):
                (silent if why == "silent" else over)[connection.peer[0]] += 1
            del self._connections[fd]
            self._other[fd] = connection.inode  # (gRPC closes its descriptor soon: not counted twice meanwhile)
        self.closed_silent += silent.total()
        self.closed_over_cap += over.total()
        self._ended_since_trim += silent.total() + over.total()
        for host in silent.keys() | over.keys():
            if not over[host] and silent[host] < FEW:  # a client waiting to retry leaves one quiet connection
                log.debug("closed %d quiet connections from %s", silent[host], host)
                continue
            self.refusals.warn(
                "closed %d connections from %s: %d carried nothing within %g s, %d were over its %d quiet "
                "connections (a flood?)",
                silent[host] + over[host],
                host,
                silent[host],
                self.handshake_timeout_s,
                over[host],
                self.max_quiet_per_peer,
            )
        self._prune(now)
        return silent.total() + over.total()

    def _scan(self, now: float) -> None:
        """Bring the table of our connections up to date with the process's descriptors."""
        try:
            names = os.listdir(_FDS)
        except OSError:
            return
        present: set[int] = set()
        for name in names:
            fd = int(name)
            try:
                status = os.fstat(fd)
            except OSError:  # (closed meanwhile, or the listing's own descriptor)
                continue
            present.add(fd)
            known = self._connections.get(fd)
            if known is not None and known.inode == status.st_ino:
                continue
            if self._other.get(fd) == status.st_ino:
                continue
            self._connections.pop(fd, None)
            peer = self._peer_of(fd, status) if stat.S_ISSOCK(status.st_mode) else None
            if peer is None:
                self._other[fd] = status.st_ino
            else:
                self._other.pop(fd, None)
                self._connections[fd] = _Connection(status.st_ino, peer, now)
        for fd in [fd for fd in self._connections if fd not in present]:
            del self._connections[fd]
        for fd in [fd for fd in self._other if fd not in present]:
            del self._other[fd]
        for fd in [fd for fd in self._listeners if fd not in present]:
            del self._listeners[fd]

    def _peer_of(self, fd: int, status: os.stat_result) -> tuple[str, int] | None:
        """The peer of a TCP connection accepted on one of our ports, or None for any other descriptor."""
        try:
            duplicate = socket.socket(fileno=os.dup(fd))
        except OSError:
            return None
        try:
            if duplicate.type != socket.SOCK_STREAM or duplicate.family not in (socket.AF_INET, socket.AF_INET6):
                return None
            if duplicate.getsockname()[1] not in self.ports:
                return None
            try:
                host, port = duplicate.getpeername()[:2]
            except OSError:  # a listening socket has no peer
                self._listeners[fd] = status.st_ino
                return None
            return _plain(host), port
        except OSError:
            return None
        finally:
            duplicate.close()

    @staticmethod
    def _shut(fd: int, inode: int) -> bool:
        """Shut down the connection on `fd` if it is still the socket `inode`; whether it was."""
        try:
            duplicate = os.dup(fd)
        except OSError:
            return False
        try:
            if os.fstat(duplicate).st_ino != inode:
                return False
            with socket.socket(fileno=duplicate) as sock:
                duplicate = -1  # (the socket object closes it)
                sock.shutdown(socket.SHUT_RDWR)
            return True
        except OSError:
            return False
        finally:
            if duplicate >= 0:
                with contextlib.suppress(OSError):
                    os.close(duplicate)

    def _prune(self, now: float) -> None:
        live = {c.peer for c in self._connections.values()}
        horizon = now - 2 * self.handshake_timeout_s
        for key in [k for k, t in self._released.items() if t < horizon and k not in live]:
            del self._released[key]

    def flush(self) -> None:
        """Write the count of the warnings the rate limit held back (at the end of a run)."""
        self.refusals.flush()


class GatedHealth(health_aio.HealthServicer):  # type: ignore[misc]  # (grpc_health has no types)
    """The standard health service, whose calls keep their connection open while they last (a Watch may
    last as long as the coordinator)."""

    def __init__(self, gate: ConnectionGate) -> None:
        super().__init__()
        self.gate = gate

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> Any:
        self.gate.enter(context.peer())
        try:
            return await super().Check(request, context)
        finally:
            self.gate.leave(context.peer())

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        self.gate.enter(context.peer())
        try:
            await super().Watch(request, context)
        finally:
            self.gate.leave(context.peer())
