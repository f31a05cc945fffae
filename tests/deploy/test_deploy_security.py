"""The compose stack's exposure, checked with compose's own parser (Debian's docker-compose; no Docker
engine needed) and the tuner's real argument checks: every published port is bound to 127.0.0.1, the
admin token, the tuner's span token and Grafana's admin password have no defaults (compose refuses to
start without them), anonymous Grafana is at most a Viewer with the login form on, the Collector sends
the tuner's token, and the deploy README no longer suggests an open receiver or a default token."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.real_backends import missing

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SECRETS = {"MOESPEC_ADMIN_TOKEN": "admin-secret", "MOESPEC_OTLP_TOKEN": "otlp-secret",
           "GRAFANA_ADMIN_PASSWORD": "grafana-secret"}


def compose_config(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`docker-compose config` on deploy/docker-compose.yml. Debian's docker-compose (1.29) predates the
    top-level `name:` key, so that one key is removed first; everything else is parsed as written."""
    binary = shutil.which("docker-compose")
    if binary is None:
        missing("docker-compose", "apt-get install docker-compose; scripts/setup_venv.sh test does it")
    spec = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert spec.pop("name") == "moespec"
    copy = tmp_path / "docker-compose.yml"
    copy.write_text(yaml.safe_dump(spec))
    environ = {k: v for k, v in os.environ.items() if k not in SECRETS and not k.startswith("COMPOSE_")}
    return subprocess.run([binary, "--project-directory", str(DEPLOY), "-f", str(copy), "--profile", "tuner",
                           "config"], capture_output=True, text=True, timeout=120, env=environ | env)


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict:
    result = compose_config(tmp_path_factory.mktemp("compose"), SECRETS)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def published(service: dict) -> list[str]:
    return [p if isinstance(p, str) else f"{p.get('host_ip', '')}:{p['published']}:{p['target']}"
            for p in service.get("ports", [])]


def test_every_published_port_is_bound_to_loopback(resolved):
    ports = {name: published(service) for name, service in resolved["services"].items()}
    assert ports["moespec"] and ports["grafana"] and ports["otel-collector"]
    for name, bindings in ports.items():
        for binding in bindings:
            assert binding.startswith("127.0.0.1:"), f"{name} publishes {binding} beyond this machine"


@pytest.mark.parametrize("variable", sorted(SECRETS))
def test_compose_refuses_to_start_without_each_secret(tmp_path, variable):
    result = compose_config(tmp_path, {k: v for k, v in SECRETS.items() if k != variable})
    assert result.returncode != 0
    assert f"set {variable}" in result.stderr


def test_the_admin_token_reaches_moespec_and_the_tuner_unchanged(resolved):
    for name in ("moespec", "tuner"):
        assert resolved["services"][name]["environment"]["MOESPEC_ADMIN_TOKEN"] == "admin-secret"
    assert "change-me" not in (DEPLOY / "docker-compose.yml").read_text()


def test_grafana_anonymous_users_are_viewers_and_the_login_form_is_on(resolved):
    env = resolved["services"]["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false" or env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert str(env.get("GF_AUTH_DISABLE_LOGIN_FORM", "false")).lower() == "false"
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == "grafana-secret"


def test_the_collector_sends_the_token_the_tuner_requires(resolved):
    collector = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    headers = collector["exporters"]["otlp/tuner"]["headers"]
    assert headers == {"authorization": "Bearer ${env:MOESPEC_OTLP_TOKEN}"}
    assert resolved["services"]["otel-collector"]["environment"]["MOESPEC_OTLP_TOKEN"] == "otlp-secret"
    assert resolved["services"]["tuner"]["environment"]["MOESPEC_OTLP_TOKEN"] == "otlp-secret"


def test_the_compose_tuner_passes_the_tuners_own_intake_check(resolved):
    """Its command line, parsed by `moespec tune`'s parser, with its environment from compose."""
    from service.cli import UsageError, build_parser
    from service.cli.tune import parse_hostport
    from tuner.measurement.receiver_auth import intake_security

    tuner = resolved["services"]["tuner"]
    assert tuner["entrypoint"] == ["moespec", "tune"]
    args = build_parser(["tune", *tuner["command"]]).parse_args(["tune", *tuner["command"]])
    host, _ = parse_hostport(args.otlp_listen, "--otlp-listen", allow_zero=True)
    assert intake_security(args, tuner["environment"], host).bearer_token == "otlp-secret"
    without = {k: v for k, v in tuner["environment"].items() if k != "MOESPEC_OTLP_TOKEN"}
    with pytest.raises(UsageError):  # the negative control: the same command without the token
        intake_security(args, without, host)
    assert "4327" not in " ".join(published(tuner))  # the receiver is not published on the host


def test_the_deploy_readme_suggests_no_open_receiver_and_no_default_token():
    readme = (DEPLOY / "README.md").read_text()
    assert "change-me" not in readme
    for line in readme.splitlines():
        if "--otlp-listen" in line:
            assert "0.0.0.0" not in line, line
    assert re.search(r"TLS", readme) and "--tls-cert" in readme and "--tls-ca" in readme
    assert "127.0.0.1" in readme and "MOESPEC_OTLP_TOKEN" in readme
