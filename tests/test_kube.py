"""`fedsaddle deploy kubernetes`: the cluster's manifests are valid against the Kubernetes API's schemas
(offline, kubernetes-validate's bundled ones), say a federation that agrees with itself (ports, indices,
paths, tokens), and the podman form is made of the same objects. scripts/kube-test.sh plays that form."""

from __future__ import annotations

import base64
import hashlib
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from fedsaddle.cli import build_parser, main
from fedsaddle.common.wire import SERVICE
from fedsaddle.server.config import parse_config

ROOT = Path(__file__).resolve().parent.parent
RUN = {
    "name": "kube",
    "problem": {"name": "paper_regression", "num_clients": 3, "dim": 4, "s": 10.0},
    "rounds": 40,
    "algorithms": [{"name": "scaffold_s", "gamma_local": 0.01}],
    "transport": {"rejoin_timeout_s": 60},
}
# grpc probes are GA from 1.27; the newest the package bundles.
VERSIONS = ("1.27.0", "1.30.0", "1.37.0")


def deploy(tmp_path: Path, run: dict[str, Any], *flags: str) -> tuple[int, Path]:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(run))
    out = tmp_path / "out"
    return main(["deploy", "kubernetes", "--config", str(config), "--out", str(out), *flags]), out


def certificates(folder: Path) -> Path:
    folder.mkdir()
    for name in ("ca.pem", "coordinator.pem", "coordinator.key"):
        (folder / name).write_text(f"-----BEGIN {name}-----\n")
    return folder


def objects(out: Path, name: str = "kubernetes.yaml") -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all((out / name).read_text())}


@pytest.mark.parametrize("flags", [(), ("--tokens",), ("--tokens", "--tls-dir", "TLS")])
def test_the_manifests_are_valid_kubernetes_objects(tmp_path: Path, flags: tuple[str, ...]) -> None:
    if "TLS" in flags:
        flags = tuple(str(certificates(tmp_path / "tls")) if f == "TLS" else f for f in flags)
    code, out = deploy(tmp_path, RUN, *flags)
    assert code == 0
    found = objects(out)
    for version in VERSIONS:
        for o in found.values():
            kubernetes_validate.validate(o, version, strict=True)  # raises on any unknown or mistyped field
    kinds = sorted(kind for kind, _ in found)
    secrets = 2 if flags else 0
    assert kinds == sorted(["ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "Service", "StatefulSet"]
                           + ["Secret"] * secrets)  # fmt: skip


def test_a_schema_violation_is_caught() -> None:
    # the check above can fail: a mistyped field of the same objects is refused
    bad = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "x"}, "spec": {"replicas": "3"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


def client_argv(command: list[str], ordinal: int) -> list[str]:
    """The client's arguments as its pod's shell makes them, in a pod named as the StatefulSet names it."""
    assert command[:2] == ["sh", "-c"] and command[2].startswith("exec fedsaddle client ")
    script = command[2].replace("exec fedsaddle", 'printf "%s\\n"', 1)
    done = subprocess.run(
        ["sh", "-c", script], env={"HOSTNAME": f"fedsaddle-client-{ordinal}"}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_each_client_pod_hosts_its_ordinal_and_reads_its_own_token(tmp_path: Path) -> None:
    code, out = deploy(tmp_path, RUN, "--tokens", "--tls-dir", str(certificates(tmp_path / "tls")))
    assert code == 0
    found = objects(out)
    deployment = found["Deployment", "fedsaddle-coordinator"]
    service = found["Service", "fedsaddle-coordinator"]
    clients = found["StatefulSet", "fedsaddle-client"]
    assert clients["spec"]["replicas"] == 3 and clients["spec"]["serviceName"] == "fedsaddle-client"
    assert found["Service", "fedsaddle-client"]["spec"]["clusterIP"] == "None"
    # the coordinator reads the ConfigMap's config, whose run is the one given
    (coordinator,) = deployment["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(coordinator["args"])
    assert args.func.__name__ == "cmd_coordinator"
    config_text = found["ConfigMap", "fedsaddle-config"]["data"]["run.yaml"]
    config = parse_config(yaml.safe_load(config_text))
    assert config.model_dump(exclude={"transport", "output"}) == parse_config(RUN).model_dump(
        exclude={"transport", "output"}
    )
    assert args.config == "/etc/fedsaddle/config/run.yaml" and args.out == config.output.dir == "/runs"
    port = int(config.transport.listen.rsplit(":", 1)[1])
    assert service["spec"]["ports"][0]["port"] == port
    assert coordinator["ports"][0]["containerPort"] == port
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    # over TLS the probe is the CLI's health check with the CA (kubelet's gRPC probe speaks plaintext only)
    # ready while the federation's service is SERVING, live while the server answers (--hold keeps it so)
    ready = build_parser().parse_args(coordinator["readinessProbe"]["exec"]["command"][1:])
    live = build_parser().parse_args(coordinator["livenessProbe"]["exec"]["command"][1:])
    for probe in (ready, live):
        assert probe.func.__name__ == "cmd_health" and probe.address == f"127.0.0.1:{port}"
        assert probe.server_name == "fedsaddle-coordinator"  # the name the certificate gives the Service
        assert probe.ca == f"{mounts_of(coordinator)['secrets']}/ca.pem"
    assert (ready.service, live.service) == (SERVICE, "")
    assert args.hold
    coordinator_files = {
        k: base64.b64decode(v).decode() for k, v in found["Secret", "fedsaddle-coordinator"]["data"].items()
    }
    client_files = {k: base64.b64decode(v).decode() for k, v in found["Secret", "fedsaddle-client"]["data"].items()}
    assert Path(config.transport.tls.cert).name in coordinator_files  # type: ignore[union-attr]
    assert "coordinator.key" not in client_files and client_files["ca.pem"] == "-----BEGIN ca.pem-----\n"
    identities = yaml.safe_load(coordinator_files[Path(str(config.transport.credentials)).name])["identities"]
    (template,) = clients["spec"]["template"]["spec"]["containers"]
    mounts = mounts_of(template)
    tokens = set()
    for ordinal in range(3):
        client = build_parser().parse_args(client_argv(template["command"], ordinal))
        assert client.func.__name__ == "cmd_client"
        assert client.clients == str(ordinal) and client.coordinator == f"fedsaddle-coordinator:{port}"
        assert client.hold  # a StatefulSet would start a client whose run is over again
        token_file = Path(client.token_file)
        assert str(token_file.parent) == mounts["secrets"]
        token = client_files[token_file.name]
        assert identities[f"client-{ordinal}"] == {
            "indices": [ordinal],
            "token_sha256": hashlib.sha256(token.encode()).hexdigest(),
        }
        tokens.add(token)
    assert len(tokens) == 3  # one token each
    # each pod's own data volume, from the claim template
    assert [c["metadata"]["name"] for c in clients["spec"]["volumeClaimTemplates"]] == ["data"]
    assert mounts["data"] == "/data"


def mounts_of(container: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in container["volumeMounts"]}


def test_plaintext_probes_ask_the_grpc_health_service(tmp_path: Path) -> None:
    code, out = deploy(tmp_path, RUN)
    assert code == 0
    (coordinator,) = objects(out)["Deployment", "fedsaddle-coordinator"]["spec"]["template"]["spec"]["containers"]
    assert coordinator["readinessProbe"]["grpc"] == {"port": 50051, "service": SERVICE}
    assert coordinator["livenessProbe"]["grpc"] == {"port": 50051, "service": ""}


def test_the_podman_form_is_made_of_the_same_objects(tmp_path: Path) -> None:
    code, out = deploy(tmp_path, RUN, "--tokens")
    assert code == 0
    cluster = objects(out)
    pods = objects(out / "podman", "pods.yaml")
    maps: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted((out / "podman").glob("configmap-*.yaml")):
        (only,) = objects(out / "podman", path.name).items()  # one a file: podman 4.3 reads no more
        maps[only[0]] = only[1]
    assert {kind for kind, _ in pods} == {"Pod", "PersistentVolumeClaim"}
    assert {kind for kind, _ in maps} == {"ConfigMap"}
    # the Deployment's pod template, named as the Service the clients dial
    deployment = cluster["Deployment", "fedsaddle-coordinator"]["spec"]["template"]["spec"]
    coordinator = pods["Pod", "fedsaddle-coordinator"]["spec"]
    assert coordinator["containers"][0]["args"] == deployment["containers"][0]["args"]
    # a Secret becomes a ConfigMap of the same files, its volume a configMap volume
    secret = cluster["Secret", "fedsaddle-client"]["data"]
    assert maps["ConfigMap", "fedsaddle-client-secret"]["data"] == {
        k: base64.b64decode(v).decode() for k, v in secret.items()
    }
    assert maps["ConfigMap", "fedsaddle-config"] == cluster["ConfigMap", "fedsaddle-config"]
    template = cluster["StatefulSet", "fedsaddle-client"]["spec"]["template"]["spec"]
    for i in range(3):
        pod = pods["Pod", f"fedsaddle-client-{i}"]["spec"]
        assert pod["containers"][0]["command"] == template["containers"][0]["command"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["secrets"]["configMap"]["name"] == "fedsaddle-client-secret"
        assert volumes["data"]["persistentVolumeClaim"]["claimName"] == f"data-fedsaddle-client-{i}"
        assert ("PersistentVolumeClaim", f"data-fedsaddle-client-{i}") in pods
        again = objects(out / "podman", f"client-{i}.yaml")  # what the controller would make again
        assert again == {("Pod", f"fedsaddle-client-{i}"): pods["Pod", f"fedsaddle-client-{i}"]}


@pytest.mark.parametrize(
    ("run", "flags", "message"),
    [
        (RUN, ("--clients", "0"), "--clients must be at least 1, got 0"),
        (RUN, ("--clients", "4"), "--clients 4 differs from the config's problem.num_clients (3)"),
        (RUN, ("--name", "Fed_Saddle"), "--name must be a Kubernetes name"),
        (RUN, ("--tls-dir", "NOWHERE"), "lacks ca.pem, coordinator.pem, coordinator.key"),
        (
            {**RUN, "transport": {"credentials": "/etc/creds.yaml"}},
            (),
            "transport.tls and transport.credentials name files on this machine",
        ),
        ({**RUN, "rounds": 0}, (), "rounds"),
    ],
)
def test_bad_requests_are_usage_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], run: dict[str, Any], flags: tuple[str, ...], message: str
) -> None:
    flags = tuple(str(tmp_path / "nowhere") if f == "NOWHERE" else f for f in flags)
    code, out = deploy(tmp_path, run, *flags)
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # nothing half-written


def test_the_example_the_podman_run_plays_can_lose_a_client(tmp_path: Path) -> None:
    # scripts/kube-test.sh deletes a client pod mid-run: its config lets the client rejoin
    run = yaml.safe_load((ROOT / "examples" / "kube-run.yaml").read_text())
    assert parse_config(run).transport.rejoin_timeout_s > 0
    code, out = deploy(tmp_path, run, "--tokens")
    assert code == 0
    for o in objects(out).values():
        kubernetes_validate.validate(o, VERSIONS[-1], strict=True)


def test_a_client_on_real_data_reads_the_file_data_split_wrote_for_its_index(tmp_path: Path) -> None:
    run = {**RUN, "problem": {"name": "auc", "num_clients": 3, "features": 3, "positive_rate": 0.5}}
    code, out = deploy(tmp_path, run)
    assert code == 0
    (template,) = objects(out)["StatefulSet", "fedsaddle-client"]["spec"]["template"]["spec"]["containers"]
    for ordinal in (0, 2):
        client = build_parser().parse_args(client_argv(template["command"], ordinal))
        assert client.data == [f"/data/client-{ordinal:03d}.npz"]  # data split's names: client-000.npz, ...
