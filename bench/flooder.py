"""A peer that holds idle connections to a coordinator, as an outsider could: bounded, loopback only.

Each connection sends the HTTP/2 client preface and an empty SETTINGS frame (and, with
--stream, the HEADERS of a Session call, but never a message), then never reads. A
connection the coordinator closes is opened again at once, so that the flood holds
`--connections` for as long as the coordinator lets it, until `--seconds` have passed.

Prints "holding N" the first time N connections are open at once (or, if a connection
cannot be opened first, how many are), and at the end how many were opened and how many
the coordinator closed. Used by bench/flood.py and
tests/test_flood.py.

    python bench/flooder.py 127.0.0.1:PORT --connections 2000 --seconds 20 [--source 127.0.0.2] [--stream]
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import select
import signal
import socket
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # an empty SETTINGS frame on stream 0
SESSION_PATH = b"/fedsaddle.v2.Coordinator/Session"


def _literal(name: bytes, value: bytes) -> bytes:
    """An HPACK header field, literal without indexing, new name, no Huffman (lengths < 127)."""
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def session_headers(authority: bytes) -> bytes:
    """A HEADERS frame (END_HEADERS) opening stream 1 as a Session call that will never send a message."""
    block = (
        b"\x83"  # :method POST (static table 3)
        + b"\x86"  # :scheme http (static table 6)
        + b"\x04"
        + bytes([len(SESSION_PATH)])
        + SESSION_PATH  # :path, name from the static table (4)
        + b"\x01"
        + bytes([len(authority)])
        + authority  # :authority (1)
        + _literal(b"content-type", b"application/grpc")
        + _literal(b"te", b"trailers")
    )
    return len(block).to_bytes(3, "big") + b"\x01\x04" + (1).to_bytes(4, "big") + block


def _open(target: tuple[str, int], source: str, hello: bytes) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((source, 0))
        sock.settimeout(2.0)
        sock.connect(target)
        sock.sendall(hello)
        sock.setblocking(False)
        return sock
    except OSError:
        sock.close()
        return None


def flood(address: str, connections: int, seconds: float, source: str, stream: bool) -> None:
    host, port = address.rsplit(":", 1)
    target = (host, int(port))
    hello = PREFACE + SETTINGS + (session_headers(address.encode()) if stream else b"")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < connections + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, connections + 64), hard))
    held: dict[int, socket.socket] = {}
    poller = select.poll()
    opened = closed = failed = 0
    said_holding = False
    end = time.monotonic() + seconds
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))  # stop, and say what happened
    try:
        while time.monotonic() < end and not stop:
            while len(held) < connections and time.monotonic() < end and not stop:
                sock = _open(target, source, hello)
                if sock is None:
                    failed += 1
                    break
                opened += 1
                held[sock.fileno()] = sock
                poller.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
            if (len(held) >= connections or failed) and not said_holding:
                # (all of them, or as many as the coordinator let it open before refusing one)
                print(f"holding {len(held)}", flush=True)
                said_holding = True
            # Only hang-ups are watched: nothing the coordinator sends is ever read.
            for fd, _ in poller.poll(100 if len(held) >= connections else 0):
                poller.unregister(fd)
                held.pop(fd).close()
                closed += 1
            if failed and len(held) < connections:
                time.sleep(0.01)  # (the port refuses: do not spin)
    finally:
        for sock in held.values():
            with contextlib.suppress(OSError):
                sock.close()
    print(f"opened {opened}, closed by the coordinator {closed}, failed to open {failed}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address", help="host:port of the coordinator (loopback)")
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--source", default="127.0.0.2", help="the address the flood comes from")
    parser.add_argument("--stream", action="store_true", help="open a Session stream on each, never say Hello")
    args = parser.parse_args()
    if not args.address.startswith("127.") or not args.source.startswith("127."):
        parser.error("the flood stays on loopback (127.0.0.0/8)")
    flood(args.address, args.connections, args.seconds, args.source, args.stream)


if __name__ == "__main__":
    main()
