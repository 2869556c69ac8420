"""Operating a federation: deploy (Kubernetes manifests, and their form for podman), health (a coordinator's
gRPC health service) and new-token (a client identity's token)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fedsaddle.cli.arguments import Commands, add_command, add_group, add_subcommand, address, indices, positive_float
from fedsaddle.cli.credentials import channel_credentials, tls_options
from fedsaddle.cli.shared import EXIT_OK, EXIT_RUN_FAILED, UsageError
from fedsaddle.common.indices import parse_indices


def cmd_deploy_kubernetes(args: argparse.Namespace) -> int:
    """Write Kubernetes manifests for a federation, and the form of them that `podman kube play` runs."""
    import yaml

    from fedsaddle import kube
    from fedsaddle.server.config import read_yaml

    try:
        raw = read_yaml(Path(args.config).read_text())
    except OSError as exc:
        raise UsageError(f"cannot read config {args.config}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise UsageError(f"config {args.config} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"config {args.config} must be a mapping of fields, got {type(raw).__name__}")
    from fedsaddle.common.problems.registry import add_plugin_folder
    from fedsaddle.server.config import parse_config

    add_plugin_folder(Path(args.config).parent)  # a plug-in problem beside its config, as load_config does
    config = parse_config(raw, source=f"config {args.config}")
    clients = args.clients if args.clients is not None else config.problem.num_clients
    options = kube.Options(
        clients=clients,
        name=args.name,
        image=args.image,
        client_image=args.client_image,
        tls_dir=Path(args.tls_dir) if args.tls_dir else None,
        tokens=args.tokens,
        runs_size=args.runs_size,
        data_size=args.data_size,
    )
    try:
        manifests = kube.cluster(raw, options)
    except kube.ManifestError as exc:
        raise UsageError(str(exc)) from None
    written = kube.write(manifests, Path(args.out))
    kinds = ", ".join(f"{o['kind']} {o['metadata']['name']}" for o in manifests.objects)
    print(f"{written[0]}: {kinds}")
    print(f"{Path(args.out) / 'podman'}: the same federation for `podman kube play` (docs/how-to/kubernetes.md)")
    names = kube.names(args.name)
    print(f"then: kubectl apply -f {written[0]}; the run directory is on the claim {names['runs']}")
    if manifests.config.transport.rejoin_timeout_s == 0:
        print(
            "note: transport.rejoin_timeout_s is 0, so a client pod that is deleted or restarted fails the run; "
            "set it (e.g. 60) for the pod to rejoin",
            file=sys.stderr,
        )
    return EXIT_OK


def cmd_health(args: argparse.Namespace) -> int:
    """Ask a coordinator's standard health service; exit 0 when it is serving."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    credentials = channel_credentials(args)
    options = [("grpc.ssl_target_name_override", args.server_name)] if args.server_name else []
    if credentials is not None:
        channel = grpc.secure_channel(args.address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}{_health_hint(args, exc)}", file=sys.stderr)
            return EXIT_RUN_FAILED
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return EXIT_OK if reply.status == health_pb2.HealthCheckResponse.SERVING else EXIT_RUN_FAILED


def _health_hint(args: argparse.Namespace, error: Any) -> str:
    """What to give when a closed connection comes from TLS: the port's answer to a TLS hello shows it
    (client/probe.py), as the client does."""
    import grpc

    from fedsaddle.client.probe import TlsFiles, probe

    text = (error.details() or "").lower()
    if error.code() != grpc.StatusCode.UNAVAILABLE or "refused" in text:
        return ""
    verdict = probe(args.address, TlsFiles(args.ca, args.cert, args.key) if args.ca else None)
    if not args.ca:
        return " (it serves TLS: give --ca)" if verdict.speaks_tls else ""
    if verdict.refused_the_client and not args.cert:
        return " (a mutual-TLS coordinator also needs --cert and --key)"
    if verdict.refused_the_client:
        return " (it does not accept this certificate: is it signed by the coordinator's client CA?)"
    return ""


def cmd_new_token(args: argparse.Namespace) -> int:
    """Print a fresh token for a client identity, and the line for the credentials file."""
    import secrets

    from fedsaddle.server.transport.auth import token_hash

    token = secrets.token_urlsafe(32)
    print(f"# give this token to {args.name} (e.g. in a file for --token-file):\n{token}\n")
    print("# and add this to the coordinator's credentials file, under `identities:`")
    spec = ",".join(str(i) for i in parse_indices(args.clients))
    print(f"  {args.name}:\n    indices: [{spec}]\n    token_sha256: {token_hash(token)}")
    return EXIT_OK


def add_commands(commands: Commands) -> None:
    """health, deploy and new-token."""
    p = add_command(commands, "health", "check a coordinator's gRPC health service (exit 0 if serving)", cmd_health)
    p.add_argument("--address", type=address(False), default="127.0.0.1:50051", help="HOST:PORT of the coordinator")
    p.add_argument("--service", default="", help="service to ask about ('' = the whole server)")
    p.add_argument("--timeout", type=positive_float, default=5.0, help="seconds to wait for the answer")
    tls_options(p)

    about = "write manifests that run a federation on a cluster"
    deploy_commands = add_group(commands, "deploy", about, "deploy_command", "TARGET", "targets")
    p = add_subcommand(
        deploy_commands,
        "kubernetes",
        help="Kubernetes manifests (and the form podman kube play runs) for a config and its clients",
        description="Write OUT/kubernetes.yaml: the config as a ConfigMap, the coordinator as a Deployment with a "
        "Service (probes: the gRPC health service), its run directories on a PersistentVolumeClaim, the clients "
        "as a StatefulSet whose pod ordinal is the client index, each pod with a data volume of its own, and TLS "
        "files and tokens as Secrets. OUT/podman/ holds the same federation in the form `podman kube play` "
        "(4.3) takes: Pods and PersistentVolumeClaims, and ConfigMaps for --configmap.",
        epilog="example:\n  fedsaddle deploy kubernetes --config run.yaml --clients 10 --tls-dir certs --tokens "
        "--out k8s/\n  kubectl apply -f k8s/kubernetes.yaml",
        func=cmd_deploy_kubernetes,
    )
    p.add_argument("--config", required=True, help="run config, YAML or JSON")
    p.add_argument(
        "--clients", type=int, help="client pods, one per index: the config's problem.num_clients (the default)"
    )
    p.add_argument("--out", required=True, help="folder for the manifests")
    p.add_argument("--name", default="fedsaddle", help="prefix of every object's name")
    p.add_argument("--image", default="fedsaddle:latest", help="the coordinator's image")
    p.add_argument("--client-image", default="fedsaddle-client:latest", help="the clients' image")
    p.add_argument(
        "--tls-dir",
        metavar="DIR",
        help="ca.pem, coordinator.pem, coordinator.key (scripts/dev-certs.sh): the coordinator serves TLS, the "
        "clients check it with ca.pem; its certificate must name the Service, NAME-coordinator",
    )
    p.add_argument(
        "--tokens",
        action="store_true",
        help="a fresh token per client index, in a Secret, and the coordinator's credentials file of their hashes",
    )
    p.add_argument("--runs-size", default="1Gi", help="storage requested for the run directories")
    p.add_argument("--data-size", default="1Gi", help="storage requested for each client's data volume")

    p = add_command(commands, "new-token", "make a token for a client identity", cmd_new_token)
    p.add_argument("--name", required=True, help="the identity's name (e.g. site-a)")
    p.add_argument("--clients", required=True, type=indices, help="indices it may speak for: 3, 0,2,5 or 0-4")
