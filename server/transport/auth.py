"""Who may join, and as which clients: TLS server credentials and client identities.

A credentials file names client identities and the indices each may speak for:

    identities:
      site-a:
        indices: 0-4                 # or a list: [0, 1, 2, 3, 4]
        token_sha256: 5e884898...    # sha256 (hex) of the identity's bearer token
      site-b:
        indices: [5, 6, 7, 8, 9]     # no token: must present a client certificate
                                     # whose common name is "site-b" (mutual TLS)

A client proves an identity with a bearer token (gRPC metadata
`authorization: Bearer <token>`) or, under mutual TLS, with its certificate's
common name. The coordinator keeps only token hashes. With no credentials file
the federation is open: any client may join as any free index.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from pathlib import Path

import grpc
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fedsaddle.common.indices import parse_indices
from fedsaddle.common.text import printable
from fedsaddle.server.config import ConfigError, TlsSpec, describe_errors
from fedsaddle.server.transport.identity import Identity as Identity  # (what a call proves)
from fedsaddle.server.transport.refusal import Refusal, Status


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class IdentitySpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    indices: tuple[int, ...] = Field(min_length=1)
    token_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")

    @field_validator("indices", mode="before")
    @classmethod
    def _ranges(cls, value: object) -> object:
        return parse_indices(value) if isinstance(value, str) else value


class CredentialsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    identities: dict[str, IdentitySpec] = Field(min_length=1)


class Authenticator:
    """Maps a call's credentials to an Identity, or refuses it."""

    def __init__(self, identities: Mapping[str, IdentitySpec]) -> None:
        self._by_token = {spec.token_sha256: name for name, spec in identities.items() if spec.token_sha256}
        self._identities = {name: Identity(name, frozenset(spec.indices)) for name, spec in identities.items()}

    @classmethod
    def from_file(cls, path: str | Path) -> Authenticator:
        try:
            data = yaml.safe_load(Path(path).read_text())
            return cls(CredentialsFile.model_validate(data).identities)
        except OSError as exc:
            raise ConfigError(f"cannot read credentials {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"credentials file {path} is not valid YAML: {exc}") from None
        except ValidationError as exc:
            raise ConfigError(f"invalid credentials file {path}:\n{describe_errors(exc)}") from None

    def identify(self, metadata: Iterable[tuple[str, str | bytes]], peer_common_names: Iterable[bytes]) -> Identity:
        """The identity a call proves; Refusal(UNAUTHENTICATED) if it proves none."""
        tokens = [str(value) for key, value in metadata if key == "authorization" and str(value).startswith("Bearer ")]
        if tokens:
            digest = token_hash(tokens[0].removeprefix("Bearer "))
            for known, name in self._by_token.items():
                if hmac.compare_digest(known, digest):
                    return self._identities[name]
            raise Refusal(Status.UNAUTHENTICATED, "unknown token")
        for common_name in peer_common_names:
            identity = self._identities.get(common_name.decode(errors="replace"))
            if identity is not None:
                return identity
        names = [printable(n, 64) for n in peer_common_names]
        if names:
            raise Refusal(Status.UNAUTHENTICATED, f"client certificate {names[:3]} names no known identity")
        raise Refusal(Status.UNAUTHENTICATED, "no credentials: send a token or a client certificate")


def server_credentials(tls: TlsSpec, client_certificates: bool = True) -> grpc.ServerCredentials:
    """TLS for the coordinator; with client_ca (and `client_certificates`), clients must show a certificate
    it signed. gRPC cannot ask for a certificate without requiring one, so token identities under mutual TLS
    use a second port (transport.token_listen) with `client_certificates=False`."""

    def read(path: str, what: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None

    pair = [(read(tls.key, "TLS key"), read(tls.cert, "TLS certificate"))]
    if tls.client_ca is None or not client_certificates:
        return grpc.ssl_server_credentials(pair)
    return grpc.ssl_server_credentials(
        pair, root_certificates=read(tls.client_ca, "client CA"), require_client_auth=True
    )
