"""How a command that dials a coordinator proves itself and checks the coordinator: the TLS options and the
channel credentials they make, and a client's token."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from fedsaddle.cli.shared import UsageError

if TYPE_CHECKING:
    import grpc


def tls_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ca", help="CA certificate (PEM) that signed the coordinator's; turns TLS on")
    p.add_argument("--cert", help="this side's certificate (PEM), for mutual TLS")
    p.add_argument("--key", help="this side's private key (PEM), for mutual TLS")
    p.add_argument("--server-name", help="name to expect in the coordinator's certificate (default: the host)")


def read_token(path: str | None) -> str:
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise UsageError(f"cannot read token file {path}: {exc.strerror}") from None
    return os.environ.get("FEDSADDLE_TOKEN", "").strip()


def channel_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """TLS credentials from --ca (and --cert/--key for mutual TLS), or None for plaintext."""
    import grpc

    if not args.ca:
        if args.cert or args.key:
            raise UsageError("--cert and --key need --ca (they are for mutual TLS)")
        return None
    if bool(args.cert) != bool(args.key):
        raise UsageError("--cert and --key go together")

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror}") from None

    return grpc.ssl_channel_credentials(
        root_certificates=read(args.ca), private_key=read(args.key), certificate_chain=read(args.cert)
    )
