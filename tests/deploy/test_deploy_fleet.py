"""deploy/'s fleet profile without Docker, checked with the real parsers: PyYAML and compose's own
parser for the files, SQLAlchemy for the storage URL, and moespec's own argument parsers for every command line (a flag
that `moespec serve` / `moespec tune` does not know, or a bad value, fails here as it would in the
container)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from sqlalchemy.engine import make_url

from service.cli import serve as serve_cli
from service.cli import tune as tune_cli
from tests.support.real_backends import missing

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
FLEET_TUNERS = ("tuner-a", "tuner-b")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def collector() -> dict:
    return yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} / ${VAR:?message} with the variables unset (a placeholder for the required)."""
    value = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)
    return re.sub(r"\$\{[A-Z_]+:\?[^}]*\}", "secret", value)


def parse(add_arguments, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    return parser.parse_args(argv)


def test_the_fleet_profile_has_postgres_a_second_replica_and_a_worker_per_replica(compose):
    services = compose["services"]
    fleet = {name for name, s in services.items() if "fleet" in s.get("profiles", [])}
    assert fleet == {"moespec-b", "postgres", *FLEET_TUNERS}
    assert services["postgres"]["image"].startswith("postgres:")
    assert "fleet-db" in compose["volumes"]
    for name in fleet:  # a published port is reachable from this machine only
        for port in services[name].get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port}"


def test_the_second_replica_is_the_first_one_with_its_own_instance_id(compose):
    a, b = compose["services"]["moespec"], compose["services"]["moespec-b"]
    assert b["build"] == a["build"] and b["image"] == a["image"]
    assert set(b["environment"]) == set(a["environment"])
    args = parse(serve_cli.add_arguments, [interpolate(x) for x in b["command"]])
    assert args.instance_id == "replica-b" and args.port == 50051


def test_each_worker_tunes_its_own_replica_in_one_postgres_study(compose):
    services = compose["services"]
    replicas, ids, studies, urls = [], set(), set(), set()
    for name in FLEET_TUNERS:
        tuner = services[name]
        assert tuner["entrypoint"] == ["moespec", "tune"]
        args = parse(tune_cli.add_arguments, [interpolate(x) for x in tuner["command"]])
        assert args.continuous
        host, _, port = args.server.rpartition(":")
        assert host in services and port == "50051"
        replicas.append(host)
        ids.add(args.tuner_id)
        studies.add(args.study)
        urls.add(args.storage)
        assert "postgres" in tuner["depends_on"] and host in tuner["depends_on"]
    assert sorted(replicas) == ["moespec", "moespec-b"] and len(ids) == 2 and len(studies) == 1
    [url] = urls
    parsed = make_url(url)
    postgres = services["postgres"]["environment"]
    assert parsed.drivername == "postgresql+psycopg2" and parsed.host == "postgres" and parsed.port == 5432
    assert parsed.username == postgres["POSTGRES_USER"] and parsed.database == postgres["POSTGRES_DB"]


def test_the_collector_sends_request_spans_to_every_fleet_worker(compose, collector):
    pipeline = collector["service"]["pipelines"]["traces/fleet"]
    assert "filter/request_spans" in pipeline["processors"]
    env = compose["services"]["otel-collector"]["environment"]
    listening = {}
    for name in FLEET_TUNERS:
        args = parse(tune_cli.add_arguments, [interpolate(x) for x in compose["services"][name]["command"]])
        listening[name] = int(args.otlp_listen.rsplit(":", 1)[1])
    targets = set()
    for exporter in pipeline["exporters"]:
        variable = re.fullmatch(r"\$\{env:([A-Z_]+)\}", collector["exporters"][exporter]["endpoint"]).group(1)
        host, _, port = interpolate(env[variable]).rpartition(":")
        targets.add((host, int(port)))
    assert targets == {(name, port) for name, port in listening.items()}


def test_compose_resolves_the_fleet_profile_with_its_own_parser(tmp_path):
    """Debian's docker-compose, as in tests/test_security_deploy.py: the fleet profile parses, its
    ports bind to loopback, and the workers get the Collector's span token and the storage password."""
    from tests.deploy.test_deploy_security import SECRETS, published

    binary = shutil.which("docker-compose")
    if binary is None:
        missing("docker-compose", "apt-get install docker-compose; scripts/setup_venv.sh test does it")
    spec = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    spec.pop("name")  # docker-compose 1.29 predates the top-level name key
    copy = tmp_path / "docker-compose.yml"
    copy.write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOESPEC_", "COMPOSE_"))}
    env |= SECRETS | {"MOESPEC_POSTGRES_PASSWORD": "pg-secret"}
    result = subprocess.run([binary, "--project-directory", str(DEPLOY), "-f", str(copy), "--profile", "fleet",
                             "config"], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert {"moespec-b", "postgres", *FLEET_TUNERS} <= set(services)
    for name in ("moespec-b", "postgres", *FLEET_TUNERS):
        assert all(b.startswith("127.0.0.1:") for b in published(services[name])), name
    for name in FLEET_TUNERS:
        assert services[name]["environment"]["MOESPEC_OTLP_TOKEN"] == "otlp-secret"
        storage = services[name]["command"][services[name]["command"].index("--storage") + 1]
        assert make_url(storage).password == "pg-secret"
