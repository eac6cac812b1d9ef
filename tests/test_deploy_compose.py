"""The compose files against the loopback script (no Docker needed): docker-compose.yml and compose.tls.yml run
alignfl/fl_app/runtime/topology.py's commands, with their images, networks, mounts and published ports; the image pins
the project's Flower; make_certs' certificates and keys."""

import re
import subprocess
import tomllib
from pathlib import Path

import flwr
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

from alignfl.fl_app.runtime.topology import compose_topology, make_certificates, supernode_entry_point
from tests.deployments import expected_commands

PROJECT_ROOT = Path(__file__).resolve().parents[1]
"""The checkout the tests run in."""

COMPOSE = PROJECT_ROOT / "docker-compose.yml"
COMPOSE_TLS = PROJECT_ROOT / "compose.tls.yml"


def compose_services(tls: bool) -> dict[str, dict]:
    """docker-compose.yml's services, with compose.tls.yml over them as ``docker compose -f … -f …`` merges
    them: an override's command replaces the base's, volumes and dependencies are added."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    if tls:
        for name, override in yaml.safe_load(COMPOSE_TLS.read_text())["services"].items():
            merged = {**services.get(name, {}), **override}
            merged["volumes"] = [*services.get(name, {}).get("volumes", []), *override.get("volumes", [])]
            merged["depends_on"] = {**services.get(name, {}).get("depends_on", {}), **override.get("depends_on", {})}
            services[name] = merged
    return services


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_compose_services_run_the_commands_of_the_loopback_script(tls):
    services = compose_services(tls)
    num_supernodes = sum(bool(re.fullmatch(r"supernode-\d+", name)) for name in services)
    assert num_supernodes == 3
    expected = expected_commands(compose_topology(tls, num_supernodes))
    # entry point + command, flags, node configs, addresses and paths, and no service more or less
    assert {name: [*service["entrypoint"], *service["command"]] for name, service in services.items()} == expected
    # the compose check runs an extra SuperNode as `compose run supernode-0 <command without the entry point>`
    assert services["supernode-0"]["entrypoint"] == supernode_entry_point(compose_topology(tls, num_supernodes))


def mount_target(volume: str) -> str:
    """The container path of a short-syntax volume ``SOURCE:TARGET[:MODE]`` (SOURCE may hold ``${VAR:-x}``)."""
    return re.sub(r"\$\{[^}]*\}", "SOURCE", volume).split(":")[1]


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_compose_wiring_images_networks_and_mounts(tls):
    services = compose_services(tls)
    assert {service["image"] for service in services.values()} == {"alignfl:flwr-1.42.0"}
    assert {service["build"] for service in services.values()} == {"."}
    for name, service in services.items():
        if name.startswith("superexec-clientapp-"):  # reaches its SuperNode's Runtime API on 127.0.0.1
            assert service["network_mode"] == f"service:supernode-{name.rsplit('-', 1)[1]}"
        mounted = [mount_target(volume) for volume in service.get("volumes", [])]
        for path in (arg for arg in service["command"] if arg.startswith("/app/certs/")):
            assert any(path == target or path.startswith(target + "/") for target in mounted), (name, path)
        if tls and re.fullmatch(r"supernode-\d+", name):  # keys are registered before any SuperNode starts
            assert service["depends_on"]["supernode-register"] == {"condition": "service_completed_successfully"}
    results = services["superexec-serverapp"]["volumes"][0]
    assert results.endswith(":/app/alignfl-results")  # results-dir's default (~/alignfl-results) in the image


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_compose_publishes_on_this_host_only_unless_told_and_reads_keys_from_a_folder_named_outside(tls):
    services = compose_services(tls)
    published = [(name, port) for name, service in services.items() for port in service.get("ports", [])]
    assert [name for name, _ in published] == ["superlink"]
    for name, port in published:  # short syntax HOST_IP:HOST_PORT:CONTAINER_PORT, each ${VAR:-x} at its default
        at_default = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", port)
        assert at_default.startswith("127.0.0.1:") and at_default.count(":") == 2, (name, port)
    keys = [volume for service in services.values() for volume in service.get("volumes", [])]
    keys = [volume for volume in keys if mount_target(volume).startswith("/app/certs")]
    assert bool(keys) == tls
    assert all(volume.startswith("${ALIGNFL_CERTS:?") for volume in keys)  # no default: it would be in the checkout


def test_image_pins_the_projects_flower():
    pinned = next(
        dep
        for dep in tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if dep.startswith("flwr[")
    )
    version = pinned.split("==")[1]
    assert version == flwr.__version__
    dockerfile = (PROJECT_ROOT / "Dockerfile").read_text()
    assert f"ARG FLWR_IMAGE=flwr/superexec:{version}-py3.11-" in dockerfile
    assert f"flwr.__version__ == '{version}'" in dockerfile


def test_make_certs_signs_the_superlink_for_its_names_and_makes_flower_readable_keys(tmp_path):
    certs = make_certificates(tmp_path / "certs", 2)
    server = x509.load_pem_x509_certificate((certs / "superlink.crt").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(names.get_values_for_type(x509.DNSName)) == {"superlink", "localhost"}
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    verified = subprocess.run(
        [
            "openssl",
            "verify",
            "-CAfile",
            certs / "ca.crt",
            certs / "superlink.crt",
            certs / "supernode-1" / "runtime.crt",
        ],
        capture_output=True,
        text=True,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    private = load_ssh_private_key((certs / "supernode-0" / "auth").read_bytes(), None)  # what flower-supernode reads
    public = load_ssh_public_key(
        (certs / "supernode-0" / "auth.pub").read_bytes()
    )  # what flwr supernode register reads
    assert private.public_key() == public and public.curve.name == "secp384r1"
    first_key = (certs / "supernode-0" / "auth").read_bytes()
    make_certificates(certs, 3)  # a larger count adds a node and keeps the others' keys
    assert (certs / "supernode-0" / "auth").read_bytes() == first_key and (certs / "supernode-2" / "auth.pub").exists()
