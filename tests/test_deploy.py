"""The container files: the compose file is valid, and every command in it is a valid fedsaddle call
whose services agree on ports, client indices and config paths."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedsaddle.cli import build_parser
from fedsaddle.common.indices import parse_indices
from fedsaddle.server.config import load_config

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]


def dockerfile_instructions() -> list[tuple[str, str]]:
    lines = (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    return [tuple(line.split(None, 1)) for line in lines if line.strip() and not line.startswith("#")]  # type: ignore[misc]


def test_compose_file_is_valid_for_docker_compose() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        if os.environ.get("FEDSADDLE_REQUIRE_COMPOSE"):
            pytest.fail("docker-compose is required here (FEDSADDLE_REQUIRE_COMPOSE is set) but not installed")
        pytest.skip("docker-compose is not installed (CI installs Debian's package)")
    done = subprocess.run(
        [binary, "-f", str(ROOT / "docker-compose.yml"), "config", "-q"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr


def test_every_command_is_a_valid_cli_call() -> None:
    parser = build_parser()
    entrypoint = json.loads(dict(dockerfile_instructions())["ENTRYPOINT"])
    assert entrypoint == ["fedsaddle"]
    with pytest.raises(SystemExit) as shown:  # the default command, --help, prints usage and exits 0
        parser.parse_args(json.loads(dict(dockerfile_instructions())["CMD"]))
    assert shown.value.code == 0
    for name, service in SERVICES.items():
        args = parser.parse_args(service["command"])
        assert args.func.__name__ in ("cmd_coordinator", "cmd_client"), name


def test_the_healthcheck_is_the_small_script_on_the_listening_port() -> None:
    coordinator = SERVICES["coordinator"]
    port = build_parser().parse_args(coordinator["command"]).listen.rsplit(":", 1)[1]
    test = coordinator["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python3", "/opt/fedsaddle/healthcheck.py"]
    assert test[3] == f"127.0.0.1:{port}"
    copied = [src for kind, src in dockerfile_instructions() if kind == "COPY"]
    assert "docker/healthcheck.py /opt/fedsaddle/healthcheck.py" in copied
    healthcheck = dict(dockerfile_instructions())["HEALTHCHECK"]
    assert "/opt/fedsaddle/healthcheck.py" in healthcheck and "fedsaddle health" not in healthcheck


def test_the_services_agree_on_ports_indices_and_config() -> None:
    parser = build_parser()
    (coordinator_name,) = [n for n, s in SERVICES.items() if s["command"][0] == "coordinator"]
    coordinator = SERVICES[coordinator_name]
    args = parser.parse_args(coordinator["command"])
    port = args.listen.rsplit(":", 1)[1]
    # the config the coordinator reads is the one mounted at that path (FEDSADDLE_RUN's default)
    volumes = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", m) for m in coordinator["volumes"]]  # ${VAR:-default}
    mounts = {m.split(":")[1]: m.split(":")[0] for m in volumes}
    config = load_config(ROOT / mounts[args.config])
    assert args.out in mounts  # outputs go to a volume
    assert mounts[args.out] in COMPOSE["volumes"]
    assert f"{port}:{port}" in coordinator["ports"]
    assert config.transport.rejoin_timeout_s > 0  # a restarted client container rejoins
    # the clients reach the coordinator by its service name and port, and together hold every index once
    held: list[int] = []
    for name, service in SERVICES.items():
        if name == coordinator_name:
            continue
        client = parser.parse_args(service["command"])
        assert client.coordinator == f"{coordinator_name}:{port}", name
        assert coordinator_name in service["depends_on"]
        assert service["restart"] == "on-failure"
        assert service["build"]["target"] == "client"  # the image without the plotting stack
        held.extend(parse_indices(client.clients))
    assert sorted(held) == list(range(config.problem.num_clients))


def test_the_image_copies_every_package_folder() -> None:
    copied = {src.split()[0] for kind, src in dockerfile_instructions() if kind == "COPY"}
    package_dirs = {"fedsaddle", "common", "client", "server", "proto", "experiments"}
    assert package_dirs <= copied
    assert "pyproject.toml" in copied
    for path in copied:
        if not path.startswith("$"):  # a build argument (the wheel directory)
            assert (ROOT / path).exists(), path


def test_every_package_folder_is_packaged() -> None:
    # A folder with an __init__.py that pyproject.toml does not list is missing from a
    # non-editable install (the container image's): its imports fail there only.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = {project["package-dir"][name]: name for name in project["packages"]}
    skipped = ("tests", "examples", "build", "docker")  # (build/ may change under us: a wheel test builds there)
    for top in ROOT.iterdir():
        if not top.is_dir() or top.name in skipped or top.name.startswith("."):
            continue
        for init in top.glob("**/__init__.py"):
            folder = init.parent.relative_to(ROOT).as_posix()
            assert folder in listed, f"{folder} is not in pyproject.toml's packages"
