"""Kubernetes manifests for a federation, and the form of them that `podman kube play` runs.

`cluster(...)` makes the manifests for a cluster, from a run config and the number of clients:

* the config, as a ConfigMap mounted into the coordinator;
* the coordinator as a Deployment (one replica, recreated rather than rolled) with a Service in front of
  it; its readiness and liveness probes ask the standard gRPC health service (a `grpc` probe; an `exec`
  probe running `fedsaddle health --ca` when the port serves TLS, which kubelet's gRPC probe cannot speak);
* its run directories on a PersistentVolumeClaim;
* the clients as a StatefulSet of one pod per client index: the pod's ordinal is the index it hosts, and
  each pod has a data volume of its own (volumeClaimTemplates), where a client's private data file goes;
* TLS credentials (the coordinator's certificate and key, the CA the clients check it with) and the
  clients' tokens (one per index, with the coordinator's credentials file of their hashes) as Secrets.

`podman_form(manifests)` makes, from those same objects, what Debian's podman 4.3 plays: Pods and
PersistentVolumeClaims in one file, and ConfigMaps (the config, and the Secrets' contents) for
`--configmap`, one a file. podman has no controllers, Services, Secrets or probes: see docs/how-to/kubernetes.md.
"""

from __future__ import annotations

import base64
import copy
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedsaddle.common import wire
from fedsaddle.common.problems.registry import problem_class
from fedsaddle.server.config import ConfigError, RunConfig, parse_config
from fedsaddle.server.transport.auth import token_hash

Manifest = dict[str, Any]

PORT = 50051
CONFIG_DIR = "/etc/fedsaddle/config"
TLS_DIR = "/etc/fedsaddle/tls"
CLIENT_SECRET_DIR = "/etc/fedsaddle/client"
DATA_DIR = "/data"
RUNS_DIR = "/runs"
TLS_FILES = ("ca.pem", "coordinator.pem", "coordinator.key")  # scripts/dev-certs.sh's names
# The client's index is its pod's ordinal, the number after the StatefulSet's name in the pod's name
# (which is its hostname): a pod index label exists only from Kubernetes 1.28, and podman sets none.
INDEX = '"${HOSTNAME##*-}"'
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class ManifestError(ValueError):
    """A request the manifests cannot be made for; the message names the option or field."""


@dataclass(frozen=True)
class Options:
    clients: int
    name: str = "fedsaddle"
    image: str = "fedsaddle:latest"
    client_image: str = "fedsaddle-client:latest"
    tls_dir: Path | None = None  # ca.pem, coordinator.pem, coordinator.key
    tokens: bool = False  # a fresh token per client index, and the credentials file of their hashes
    runs_size: str = "1Gi"
    data_size: str = "1Gi"


@dataclass(frozen=True)
class Manifests:
    objects: list[Manifest]  # the cluster's, in the order `kubectl apply` should create them
    config: RunConfig  # the run config the ConfigMap holds
    config_text: str  # and its text

    def by_kind(self, kind: str) -> list[Manifest]:
        return [o for o in self.objects if o["kind"] == kind]


def names(name: str) -> dict[str, str]:
    return {
        "config": f"{name}-config",
        "coordinator": f"{name}-coordinator",
        "runs": f"{name}-runs",
        "clients": f"{name}-client",
        "coordinator_secret": f"{name}-coordinator",
        "client_secret": f"{name}-client",
    }


def _check(options: Options, config: RunConfig) -> None:
    if options.clients < 1:
        raise ManifestError(f"--clients must be at least 1, got {options.clients}")
    if options.clients != config.problem.num_clients:
        raise ManifestError(
            f"--clients {options.clients} differs from the config's problem.num_clients "
            f"({config.problem.num_clients}): each client pod hosts the one index that is its ordinal"
        )
    if not NAME.match(options.name) or len(options.name) > 40:
        raise ManifestError(
            f"--name must be a Kubernetes name of at most 40 characters (lower-case letters, digits and '-', "
            f"starting and ending with a letter or digit), got {options.name!r}"
        )
    if config.transport.tls is not None or config.transport.credentials is not None:
        raise ManifestError(
            "the config's transport.tls and transport.credentials name files on this machine; leave them out: "
            "--tls-dir and --tokens put TLS and tokens in Secrets and set them"
        )
    if config.transport.token_listen is not None:
        raise ManifestError("transport.token_listen is not supported by these manifests; leave it out")
    if options.tls_dir is not None:
        missing = [f for f in TLS_FILES if not (options.tls_dir / f).is_file()]
        if missing:
            raise ManifestError(
                f"--tls-dir {options.tls_dir} lacks {', '.join(missing)} (scripts/dev-certs.sh's names)"
            )


def config_for_cluster(raw: Mapping[str, Any], options: Options) -> tuple[RunConfig, str]:
    """The run config the ConfigMap holds: `raw` with the coordinator's paths inside the pod."""
    data = copy.deepcopy(dict(raw))
    transport = dict(data.get("transport") or {})
    transport["listen"] = f"0.0.0.0:{PORT}"
    if options.tls_dir is not None:
        transport["tls"] = {"cert": f"{TLS_DIR}/coordinator.pem", "key": f"{TLS_DIR}/coordinator.key"}
    if options.tokens:
        transport["credentials"] = f"{TLS_DIR}/credentials.yaml"
    data["transport"] = transport
    data["output"] = {**(data.get("output") or {}), "dir": RUNS_DIR}
    try:
        config = parse_config(data, source="the config for the cluster")
    except ConfigError as exc:
        raise ManifestError(str(exc)) from None
    return config, yaml.safe_dump(data, sort_keys=False)


def cluster(raw: Mapping[str, Any], options: Options) -> Manifests:
    """The manifests for a cluster; `raw` is the run config as read (a mapping of fields)."""
    try:
        original = parse_config(dict(raw))
    except ConfigError as exc:
        raise ManifestError(str(exc)) from None
    _check(options, original)
    config, config_text = config_for_cluster(raw, options)
    n = names(options.name)
    labels = {"app.kubernetes.io/name": "fedsaddle", "app.kubernetes.io/instance": options.name}
    objects: list[Manifest] = [
        _object("ConfigMap", n["config"], labels, data={"run.yaml": config_text}),
    ]
    coordinator_files: dict[str, str] = {}
    client_files: dict[str, str] = {}
    if options.tls_dir is not None:
        for f in ("coordinator.pem", "coordinator.key"):
            coordinator_files[f] = (options.tls_dir / f).read_text()
        client_files["ca.pem"] = (options.tls_dir / "ca.pem").read_text()
        coordinator_files["ca.pem"] = client_files["ca.pem"]  # for the exec probe's `fedsaddle health --ca`
    if options.tokens:
        identities: dict[str, Any] = {}
        for i in range(options.clients):
            token = secrets.token_urlsafe(32)
            client_files[f"token-{i}"] = token
            identities[f"client-{i}"] = {"indices": [i], "token_sha256": token_hash(token)}
        coordinator_files["credentials.yaml"] = yaml.safe_dump({"identities": identities}, sort_keys=False)
    if coordinator_files:
        objects.append(_secret(n["coordinator_secret"], labels, coordinator_files))
    if client_files:
        objects.append(_secret(n["client_secret"], labels, client_files))
    objects.append(_pvc(n["runs"], labels, options.runs_size))
    objects += _coordinator(n, labels, options, bool(coordinator_files))
    objects += _clients(n, labels, options, config, bool(client_files))
    return Manifests(objects, config, config_text)


def _object(kind: str, name: str, labels: Mapping[str, str], **fields: Any) -> Manifest:
    version = "apps/v1" if kind in ("Deployment", "StatefulSet") else "v1"
    return {"apiVersion": version, "kind": kind, "metadata": {"name": name, "labels": dict(labels)}, **fields}


def _secret(name: str, labels: Mapping[str, str], files: Mapping[str, str]) -> Manifest:
    data = {k: base64.b64encode(v.encode()).decode() for k, v in files.items()}
    return _object("Secret", name, labels, type="Opaque", data=data)


def _pvc(name: str, labels: Mapping[str, str], size: str) -> Manifest:
    spec = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}}
    return _object("PersistentVolumeClaim", name, labels, spec=spec)


def _probe(n: Mapping[str, str], options: Options, service: str) -> Manifest:
    """A probe that asks the coordinator's standard health service about `service` ('' the server)."""
    if options.tls_dir is None:
        return {"grpc": {"port": PORT, "service": service}}
    # kubelet's gRPC probe speaks plaintext only: over TLS, the CLI's health check with the CA. It dials the
    # pod itself, not the Service, which routes only to pods already ready; the certificate names the Service.
    command = [
        "fedsaddle",
        "--quiet",
        "health",
        "--address",
        f"127.0.0.1:{PORT}",
        "--server-name",
        n["coordinator"],
        "--ca",
        f"{TLS_DIR}/ca.pem",
    ]
    return {"exec": {"command": [*command, "--service", service]}}


def _coordinator(n: Mapping[str, str], labels: Mapping[str, str], options: Options, secret: bool) -> list[Manifest]:
    selector = {**labels, "app.kubernetes.io/component": "coordinator"}
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "runs", "mountPath": RUNS_DIR},
    ]
    volumes: list[Manifest] = [
        {"name": "config", "configMap": {"name": n["config"]}},
        {"name": "runs", "persistentVolumeClaim": {"claimName": n["runs"]}},
    ]
    if secret:
        mounts.append({"name": "secrets", "mountPath": TLS_DIR, "readOnly": True})
        volumes.append({"name": "secrets", "secret": {"secretName": n["coordinator_secret"]}})
    # Ready: the federation's service is SERVING (it stops being so when the run ends); live: the server
    # answers (it still does once the run has ended, under --hold).
    ready, live = _probe(n, options, wire.SERVICE), _probe(n, options, "")
    container = {
        "name": "coordinator",
        "image": options.image,
        "imagePullPolicy": "IfNotPresent",
        # --hold: a Deployment restarts a container that exits, which would start the run again.
        "args": ["coordinator", "--config", f"{CONFIG_DIR}/run.yaml", "--out", RUNS_DIR, "--hold"],
        "ports": [{"name": "grpc", "containerPort": PORT}],
        "volumeMounts": mounts,
        "readinessProbe": {**ready, "periodSeconds": 5, "timeoutSeconds": 5},
        "livenessProbe": {**live, "initialDelaySeconds": 10, "periodSeconds": 10, "timeoutSeconds": 5},
    }
    pod = {
        "metadata": {"labels": selector},
        "spec": {
            # SIGTERM first: the coordinator writes its outputs and tells the clients the run is over.
            "terminationGracePeriodSeconds": 30,
            "securityContext": {"runAsUser": 1000, "fsGroup": 1000},
            "containers": [container],
            "volumes": volumes,
        },
    }
    deployment = _object(
        "Deployment",
        n["coordinator"],
        labels,
        # One coordinator at a time: a rolling update would start a second run beside the first.
        spec={"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": selector}, "template": pod},
    )
    service = _object(
        "Service",
        n["coordinator"],
        labels,
        spec={"selector": selector, "ports": [{"name": "grpc", "port": PORT, "targetPort": "grpc"}]},
    )
    return [deployment, service]


def _clients(
    n: Mapping[str, str], labels: Mapping[str, str], options: Options, config: RunConfig, secret: bool
) -> list[Manifest]:
    selector = {**labels, "app.kubernetes.io/component": "client"}
    words = [
        "exec fedsaddle client",
        f"--coordinator {n['coordinator']}:{PORT}",
        f"--clients {INDEX}",
        '--name "$HOSTNAME"',
        "--connect-timeout 120",
        "--hold",  # a StatefulSet restarts a container that exits, even when its run is over
    ]
    if not problem_class(config.problem.name, config.problem.plugin).synthetic:
        # the names `fedsaddle data split` writes: client-000.npz, client-001.npz, ...
        words.append(f'--data {DATA_DIR}/client-"$(printf %03d {INDEX})".npz')
    if options.tls_dir is not None:
        words.append(f"--ca {CLIENT_SECRET_DIR}/ca.pem")
    if options.tokens:
        words.append(f"--token-file {CLIENT_SECRET_DIR}/token-{INDEX}")
    mounts: list[Manifest] = [{"name": "data", "mountPath": DATA_DIR}]
    volumes: list[Manifest] = []
    if secret:
        mounts.append({"name": "secrets", "mountPath": CLIENT_SECRET_DIR, "readOnly": True})
        volumes.append({"name": "secrets", "secret": {"secretName": n["client_secret"]}})
    container = {
        "name": "client",
        "image": options.client_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", " ".join(words)],
        "volumeMounts": mounts,
    }
    spec: Manifest = {
        "terminationGracePeriodSeconds": 10,
        "securityContext": {"runAsUser": 1000, "fsGroup": 1000},
        "containers": [container],
    }
    if volumes:
        spec["volumes"] = volumes
    claim = {
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": options.data_size}}},
    }
    # The StatefulSet's governing Service: headless, it gives each client pod a stable DNS name.
    headless = _object("Service", n["clients"], labels, spec={"clusterIP": "None", "selector": selector})
    return [
        headless,
        _object(
            "StatefulSet",
            n["clients"],
            labels,
            spec={
                "serviceName": n["clients"],
                "replicas": options.clients,
                # All at once: the coordinator waits for every client to join before the first round.
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": selector},
                "template": {"metadata": {"labels": selector}, "spec": spec},
                "volumeClaimTemplates": [claim],
            },
        ),
    ]


# -- the form podman 4.3 plays -------------------------------------------------------------


@dataclass(frozen=True)
class PodmanForm:
    pods: list[Manifest]  # PersistentVolumeClaims and Pods, for `podman kube play FILE`
    configmaps: list[Manifest]  # for `--configmap FILE,...`, one a file
    client_pods: dict[int, Manifest]  # index -> its Pod with its claim, to play again after a deletion


def podman_form(manifests: Manifests) -> PodmanForm:
    """What `podman kube play` (4.3) runs, made from the cluster's own objects.

    * a ConfigMap stays a ConfigMap; a Secret becomes a ConfigMap of its decoded files, and a `secret`
      volume a `configMap` volume (podman 4.3 plays no Secrets);
    * the Deployment becomes its pod template, a Pod named as the Service: on podman's network a pod is
      reached by its name, as the Service is in a cluster; probes are left out (podman runs health checks
      through systemd timers only; the test asks the health service the way the probe does);
    * the StatefulSet becomes a Pod per ordinal, named `NAME-ORDINAL` as the controller names them, each
      with its own PersistentVolumeClaim `data-NAME-ORDINAL` from the claim template.
    """
    configmaps: list[Manifest] = []
    pods: list[Manifest] = []
    clients: dict[int, Manifest] = {}
    for o in manifests.objects:
        kind, name, labels = o["kind"], o["metadata"]["name"], o["metadata"]["labels"]
        if kind == "ConfigMap":
            configmaps.append(o)
        elif kind == "Secret":
            data = {k: base64.b64decode(v).decode() for k, v in o["data"].items()}
            configmaps.append(_object("ConfigMap", _secret_map(name), labels, data=data))
        elif kind == "PersistentVolumeClaim":
            pods.append(o)
        elif kind == "Deployment":
            pods.append(_pod(name, o["spec"]["template"], probes=False))
        elif kind == "StatefulSet":
            (claim,) = o["spec"]["volumeClaimTemplates"]
            for i in range(o["spec"]["replicas"]):
                pod_name = f"{name}-{i}"
                claim_name = f"{claim['metadata']['name']}-{pod_name}"
                template = copy.deepcopy(o["spec"]["template"])
                spec = template["spec"]
                spec.setdefault("volumes", []).append(
                    {"name": claim["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim_name}}
                )
                pvc = _object("PersistentVolumeClaim", claim_name, labels, spec=claim["spec"])
                pod = _pod(pod_name, template, probes=False)
                clients[i] = pod
                pods += [pvc, pod]
    return PodmanForm(pods, configmaps, clients)


def _secret_map(name: str) -> str:
    return f"{name}-secret"


def _pod(name: str, template: Manifest, probes: bool) -> Manifest:
    template = copy.deepcopy(template)
    spec = template["spec"]
    for container in spec["containers"]:
        if not probes:
            container.pop("readinessProbe", None)
            container.pop("livenessProbe", None)
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            volume["configMap"] = {"name": _secret_map(volume.pop("secret")["secretName"])}
    # podman 4.3 does not map fsGroup onto volumes: the claim's volume is the image user's to write.
    spec.pop("securityContext", None)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, **template["metadata"]}, "spec": spec}


# -- files -------------------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """Plain YAML for manifests: no anchors for repeated mappings, files as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def documents(objects: list[Manifest]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False)


def write(manifests: Manifests, out: Path) -> list[Path]:
    """Write the cluster's manifests to out/kubernetes.yaml and podman's form to out/podman/; the paths written.

    podman's form: pods.yaml (Pods and claims), a file per ConfigMap (podman 4.3 reads one ConfigMap
    from each file given to --configmap), and a file per client Pod, to play one again."""
    form = podman_form(manifests)
    out.mkdir(parents=True, exist_ok=True)
    (out / "podman").mkdir(exist_ok=True)
    written = {
        out / "kubernetes.yaml": documents(manifests.objects),
        out / "podman" / "pods.yaml": documents(form.pods),
    }
    for configmap in form.configmaps:
        written[out / "podman" / f"configmap-{configmap['metadata']['name']}.yaml"] = documents([configmap])
    for i, pod in form.client_pods.items():  # one pod again, as the StatefulSet's controller makes it
        written[out / "podman" / f"client-{i}.yaml"] = documents([pod])
    for path, text in written.items():
        path.write_text(text)
        path.chmod(0o600)  # Secrets' contents: the owner's to read
    return list(written)
