"""TLS, mutual TLS and client credentials over real connections with throwaway certificates."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import client_process, config, stop_processes

from fedsaddle.server.config import ConfigError, RunConfig, TlsSpec
from fedsaddle.server.driver import run_algorithm
from fedsaddle.server.transport.auth import Authenticator, server_credentials, token_hash
from fedsaddle.server.transport.grpc_pool import GrpcPool
from fedsaddle.server.transport.local_pool import LocalPool

RUN = config(
    problem={"name": "paper_regression", "num_clients": 3, "dim": 4, "s": 2.0},
    algorithms=[{"name": "scaffold_s", "gamma_local": 0.05}],
    rounds=11,
)
SECURE_RUN = RUN.model_copy(update={"privacy": RUN.privacy.model_copy(update={"secure_aggregation": True})})
TOKENS = {"site-a": "token-of-site-a", "site-b": "token-of-site-b"}


@pytest.fixture
def credentials_file(tmp_path: Path) -> Path:
    path = tmp_path / "credentials.yaml"
    path.write_text(
        "identities:\n"
        f"  site-a: {{indices: 0-1, token_sha256: {token_hash(TOKENS['site-a'])}}}\n"
        f"  site-b: {{indices: [2], token_sha256: {token_hash(TOKENS['site-b'])}}}\n"
    )
    return path


def client(address: str, indices: str, *args: str) -> subprocess.Popen[str]:
    return client_process(address, indices, "--connect-timeout", "10", *args, text=True, quiet=False)


def refused(process: subprocess.Popen[str]) -> str:
    """The process must exit 1 by itself; returns its log."""
    _, err = process.communicate(timeout=30)
    assert process.returncode == 1, err
    return err


def token_args(tmp_path: Path, name: str, token: str | None = None) -> list[str]:
    path = tmp_path / f"{name}.token"
    path.write_text((token or TOKENS[name]) + "\n")
    return ["--token-file", str(path)]


def run_and_compare(pool: GrpcPool, processes: list[subprocess.Popen[str]], run: RunConfig = RUN) -> None:
    try:
        pool.wait_for_clients(30)
        remote = run_algorithm(run.algorithms[0], run, pool)
    finally:
        pool.close()
        codes = stop_processes(processes)  # type: ignore[arg-type]
    assert codes == [0] * len(processes)
    local = run_algorithm(run.algorithms[0], run, LocalPool())
    assert remote.status == local.status == "ok", remote.detail
    assert remote.z_sha256 == local.z_sha256
    assert ("privacy" in remote.traffic) == run.privacy.secure_aggregation


@pytest.fixture
def pools() -> Iterator[list[GrpcPool]]:
    made: list[GrpcPool] = []
    yield made
    for pool in made:
        pool.close()


def make_pool(pools: list[GrpcPool], **options: Any) -> GrpcPool:
    pool = GrpcPool(3, "127.0.0.1:0", **options)
    pools.append(pool)
    return pool


def test_tokens_let_each_identity_speak_only_for_its_clients(
    tmp_path: Path, credentials_file: Path, pools: list[GrpcPool]
) -> None:
    pool = make_pool(pools, authenticator=Authenticator.from_file(credentials_file))
    # Refused, each with its reason, before the real clients join:
    assert "UNAUTHENTICATED: no credentials" in refused(client(pool.address, "0"))
    assert "UNAUTHENTICATED: unknown token" in refused(
        client(pool.address, "0", *token_args(tmp_path, "site-a", "guess"))
    )
    denied = refused(client(pool.address, "0-2", *token_args(tmp_path, "site-b")))
    assert "PERMISSION_DENIED: identity 'site-b' may not speak for clients [0, 1]" in denied
    assert pool.missing() == [0, 1, 2]  # none of them joined
    good = [
        client(pool.address, "0-1", *token_args(tmp_path, "site-a")),
        client(pool.address, "2", *token_args(tmp_path, "site-b")),
    ]
    run_and_compare(pool, good)


def test_tls_serves_clients_that_trust_the_ca_and_refuses_plaintext(certs: Path, pools: list[GrpcPool]) -> None:
    tls = TlsSpec(cert=str(certs / "coordinator.pem"), key=str(certs / "coordinator.key"))
    pool = make_pool(pools, server_credentials=server_credentials(tls))
    assert "it serves TLS (give --ca)" in refused(client(pool.address, "0"))  # plaintext to a TLS port
    good = [client(pool.address, str(i), "--ca", str(certs / "ca.pem")) for i in range(3)]
    run_and_compare(pool, good)


def test_mutual_tls_binds_client_certificates_to_indices(tmp_path: Path, certs: Path, pools: list[GrpcPool]) -> None:
    credentials = tmp_path / "credentials.yaml"
    credentials.write_text("identities:\n  site-a: {indices: [0, 1]}\n  site-b: {indices: [2]}\n")
    tls = TlsSpec(
        cert=str(certs / "coordinator.pem"), key=str(certs / "coordinator.key"), client_ca=str(certs / "ca.pem")
    )
    pool = make_pool(
        pools, server_credentials=server_credentials(tls), authenticator=Authenticator.from_file(credentials)
    )
    ca = ["--ca", str(certs / "ca.pem")]

    def cert(name: str) -> list[str]:
        return [*ca, "--cert", str(certs / f"{name}.pem"), "--key", str(certs / f"{name}.key")]

    assert "it requires a client certificate (mutual TLS: give --cert and --key)" in refused(
        client(pool.address, "0", *ca)
    )
    assert "PERMISSION_DENIED: identity 'site-b' may not speak for clients [0]" in refused(
        client(pool.address, "0", *cert("site-b"))
    )
    assert "UNAUTHENTICATED: client certificate ['intruder'] names no known identity" in refused(
        client(pool.address, "2", *cert("intruder"))
    )
    run_and_compare(pool, [client(pool.address, "0-1", *cert("site-a")), client(pool.address, "2", *cert("site-b"))])


def test_secure_aggregation_runs_over_mutual_tls_with_credentials(
    tmp_path: Path, certs: Path, pools: list[GrpcPool]
) -> None:
    """Secure aggregation's key directory and unmasking travel over the same authenticated streams."""
    credentials = tmp_path / "credentials.yaml"
    credentials.write_text("identities:\n  site-a: {indices: [0, 1]}\n  site-b: {indices: [2]}\n")
    tls = TlsSpec(
        cert=str(certs / "coordinator.pem"), key=str(certs / "coordinator.key"), client_ca=str(certs / "ca.pem")
    )
    pool = make_pool(
        pools, server_credentials=server_credentials(tls), authenticator=Authenticator.from_file(credentials)
    )

    def cert(name: str) -> list[str]:
        return [
            "--ca",
            str(certs / "ca.pem"),
            "--cert",
            str(certs / f"{name}.pem"),
            "--key",
            str(certs / f"{name}.key"),
        ]

    processes = [client(pool.address, "0-1", *cert("site-a")), client(pool.address, "2", *cert("site-b"))]
    run_and_compare(pool, processes, SECURE_RUN)


def test_the_health_service_answers_over_tls(certs: Path, pools: list[GrpcPool]) -> None:
    tls = TlsSpec(cert=str(certs / "coordinator.pem"), key=str(certs / "coordinator.key"))
    pool = make_pool(pools, server_credentials=server_credentials(tls))
    done = subprocess.run(
        [sys.executable, "-m", "fedsaddle", "health", "--address", pool.address, "--ca", str(certs / "ca.pem")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{pool.address}: SERVING"
    pool.close()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedsaddle",
            "health",
            "--address",
            pool.address,
            "--ca",
            str(certs / "ca.pem"),
            "--timeout",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1


def test_bad_credentials_files_name_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "credentials.yaml"
    path.write_text("identities:\n  site-a: {indices: 0-1, token_sha256: not-a-hash}\n")
    with pytest.raises(ConfigError) as caught:
        Authenticator.from_file(path)
    assert "identities.site-a.token_sha256: String should match pattern" in str(caught.value)
    assert "(got 'not-a-hash')" in str(caught.value)
