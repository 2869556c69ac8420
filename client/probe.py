"""What a coordinator that closes a client's connections speaks, found out by asking it once with TLS.

A connection closed before a session starts says nothing on its own: a coordinator at
its connection limit, a flood's victim, and a TLS port met in plaintext all close it.
Only what the coordinator sends back tells them apart. So a client whose connections
keep closing sends one TLS ClientHello (with ALPN h2, as gRPC does) on a connection of
its own and reads the answer:

- a TLS handshake, or a TLS alert record: the port speaks TLS. A plaintext client is
  then told to give --ca. A TLS client whose handshake is followed by a close before
  any byte (gRPC's mutual TLS under TLS 1.3), or refused by an alert about its
  certificate, is told it needs a client certificate, or one the coordinator accepts;
- anything else (HTTP/2 bytes, an empty close, a reset): nothing learned; keep trying.

The probe verifies nothing (it only reads what the peer says) and sends nothing but
the handshake: it carries no credentials beyond the client certificate the client was
given anyway.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from dataclasses import dataclass

PROBE_TIMEOUT_S = 3.0

# OpenSSL's reasons for the alerts a TLS server sends when it refuses a client's certificate (or its lack).
_REFUSED = (
    "CERTIFICATE_REQUIRED",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE",
    "UNKNOWN_CA",
    "BAD_CERTIFICATE",
    "CERTIFICATE_UNKNOWN",
    "ACCESS_DENIED",
)


@dataclass(frozen=True)
class TlsFiles:
    """The PEM files a TLS client was given (the probe needs the client certificate to show it)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class Verdict:
    """What the coordinator's port answered a TLS ClientHello with."""

    speaks_tls: bool  # False: it answered with something else, or not at all (nothing learned)
    alert: str = ""  # the TLS alert it sent, if it sent one (OpenSSL's reason, e.g. TLSV13_ALERT_CERTIFICATE_REQUIRED)
    # The handshake completed, and the port closed the connection before sending a byte: gRPC's mutual TLS
    # does that to a client without a certificate it accepts (TLS 1.3 checks it after the handshake).
    closed_after_handshake: bool = False

    @property
    def refused_the_client(self) -> bool:
        """It refused this client's certificate, or the lack of one."""
        return self.closed_after_handshake or any(reason in self.alert for reason in _REFUSED)


def probe(address: str, files: TlsFiles | None = None, timeout: float = PROBE_TIMEOUT_S) -> Verdict:
    """Send the port at `address` (host:port) a TLS ClientHello and say what came back."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # a verdict on what it speaks, not on whom to trust
    context.set_alpn_protocols(["h2"])
    if files is not None and files.cert and files.key:
        with contextlib.suppress(OSError, ssl.SSLError):  # (gRPC fails it later, in its own words)
            context.load_cert_chain(files.cert, files.key)
    try:
        with (
            socket.create_connection((host, int(port)), timeout=timeout) as raw,
            context.wrap_socket(raw, do_handshake_on_connect=False) as tls,
        ):
            tls.do_handshake()
            # An accepting gRPC server sends its HTTP/2 SETTINGS at once; a refusing one closes.
            try:
                first = tls.recv(1)
            except TimeoutError:
                return Verdict(True)
            return Verdict(True, closed_after_handshake=not first)
    except ssl.SSLError as error:
        reason = str(error.reason or error)
        return Verdict("ALERT" in reason.upper(), reason)
    except (OSError, ValueError):
        return Verdict(False)
