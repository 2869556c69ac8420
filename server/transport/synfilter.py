"""New connections from a flooding address, refused in the kernel before gRPC accepts them.

gRPC accepts every TCP connection and allocates for it (about 20 KiB, and a call's memory for each
stream) before the coordinator's code can see it: a peer that opens thousands of connections at once
costs the coordinator that much before the gate (gate.py) can close any of them. Once an address is
known to flood (its streams are refused for being over its quiet cap), the gate attaches a classic BPF
socket filter to the coordinator's listening sockets that drops that address's SYN segments: its new
connections are never established (its kernel retries the SYN, at no cost to the coordinator), while its
established connections and every other address are untouched. The filter is lifted when the address
has gone quiet. Linux only; elsewhere `attach` raises OSError and the gate does without.

Only SYN segments without ACK are dropped: a listening socket's filter is inherited by the connections
it accepts, and this one never touches their traffic.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import struct
from collections.abc import Iterable

SO_ATTACH_FILTER, SO_DETACH_FILTER = 26, 27  # <asm-generic/socket.h> (the socket module does not name them)
_AD_PROTOCOL = -0x1000  # SKF_AD_OFF + SKF_AD_PROTOCOL: the packet's ethertype
_NET = -0x100000  # SKF_NET_OFF: offsets from the network (IP) header
_LD_W, _LD_H, _LD_B = 0x20, 0x28, 0x30  # BPF_LD | BPF_ABS | W/H/B
_AND_K, _JEQ_K, _RET_K = 0x54, 0x15, 0x06
_ACCEPT, _DROP = 0xFFFFFFFF, 0
_IPV4, _IPV6 = 0x0800, 0x86DD
MAX_V4, MAX_V6 = 100, 24  # addresses per filter (BPF's jumps are 8-bit: each family's block stays < 256)


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def program(hosts: Iterable[str]) -> list[bytes]:
    """The filter that drops SYNs from `hosts` (IPv4 or IPv6 addresses; others are skipped) and accepts
    every other segment."""
    v4: list[int] = []
    v6: list[tuple[int, ...]] = []
    for host in hosts:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            continue
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if isinstance(address, ipaddress.IPv4Address) and len(v4) < MAX_V4:
            v4.append(int(address))
        elif isinstance(address, ipaddress.IPv6Address) and len(v6) < MAX_V6:
            v6.append(struct.unpack("!4I", address.packed))
    ops = [
        _op(_LD_B, 13),  # the TCP header's flags (a TCP socket's filter sees the segment from its header)
        _op(_AND_K, 0x12),
        _op(_JEQ_K, 0x02, jt=1),  # SYN without ACK: on to the address; anything else: accepted
        _op(_RET_K, _ACCEPT),
        _op(_LD_H, _AD_PROTOCOL),
    ]
    v4_block = [_op(_LD_W, _NET + 12)]  # the IPv4 source address
    for source in v4:
        v4_block += [_op(_JEQ_K, source, jf=1), _op(_RET_K, _DROP)]
    v4_block.append(_op(_RET_K, _ACCEPT))
    ops.append(_op(_JEQ_K, _IPV4, jf=len(v4_block)))
    ops += v4_block
    v6_block: list[bytes] = []
    for words in v6:  # the IPv6 source address, word by word; a mismatch skips to the next address
        for i, word in enumerate(words):
            v6_block += [_op(_LD_W, _NET + 8 + 4 * i), _op(_JEQ_K, word, jf=7 - 2 * i)]
        v6_block.append(_op(_RET_K, _DROP))
    v6_block.append(_op(_RET_K, _ACCEPT))
    ops.append(_op(_JEQ_K, _IPV6, jf=len(v6_block)))  # (the accumulator still holds the ethertype)
    ops += v6_block
    ops.append(_op(_RET_K, _ACCEPT))
    return ops


def attach(sock: socket.socket, ops: list[bytes]) -> None:
    """Put the filter on `sock` (the kernel copies it); OSError where socket filters do not exist."""
    code = ctypes.create_string_buffer(b"".join(ops))
    fprog = struct.pack("@HP", len(ops), ctypes.addressof(code))  # struct sock_fprog
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


def detach(sock: socket.socket) -> None:
    """Take any filter off `sock` (none there is not an error)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_DETACH_FILTER, 0)
    except OSError as error:
        if error.errno != 2:  # ENOENT: there was none
            raise
