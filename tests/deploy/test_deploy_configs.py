"""deploy/ without Docker: every file parses, the pieces name each other consistently, and the
dashboard queries only metrics, labels and span attributes the service really emits (names derived
from otel/attributes.py, the same table the exporters use)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from otel import attributes as a
from tests.support.real_backends import missing

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
REPO = DEPLOY.parent


def load_yaml(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml("docker-compose.yml")


@pytest.fixture(scope="module")
def collector() -> dict:
    return load_yaml("otel-collector.yaml")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana/dashboards/moespec.json").read_text())


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1].strip("/"))


def test_every_yaml_file_parses():
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(files) >= 6
    for path in files:
        assert isinstance(yaml.safe_load(path.read_text()), dict), path


def test_compose_has_the_whole_stack_and_its_mounts_exist(compose):
    services = compose["services"]
    assert {"moespec", "otel-collector", "jaeger", "tempo", "prometheus", "grafana"} <= set(services)
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source}"
        for dep in service.get("depends_on", []):
            assert dep in services, f"{name} depends on unknown {dep}"
    assert "contrib" in services["otel-collector"]["image"]
    assert services["jaeger"]["image"].split(":")[1].startswith("2.")  # Jaeger v2


def test_moespec_service_is_built_from_the_repository_dockerfile(compose):
    build = compose["services"]["moespec"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == (REPO / "Dockerfile").resolve()


def test_moespec_exports_to_the_collectors_otlp_grpc_receiver(compose, collector):
    env = compose["services"]["moespec"]["environment"]
    endpoint = env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert endpoint.startswith("http://otel-collector:") and env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert port_of(endpoint) == port_of(collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    # Only standard OTEL_* variables (and moespec's verify ratio) configure telemetry.
    assert all(k.startswith(("OTEL_", "MOESPEC_")) for k in env)


def test_the_service_environment_parses_as_telemetry_config(compose):
    from otel.config import TelemetryConfig

    env = {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v))
           for k, v in compose["services"]["moespec"]["environment"].items()}
    config = TelemetryConfig.from_environ(env)
    assert config.traces_exporters == ("otlp",) and config.metrics_exporters == ("otlp",)
    assert config.verify_span_ratio == 0.1


def test_collector_pipelines_reference_defined_components(collector):
    for pipeline_name, pipeline in collector["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in collector[kind], f"{pipeline_name}: {kind} {component} is not defined"
        assert pipeline["receivers"] and pipeline["exporters"]
    for extension in collector["service"].get("extensions", []):
        assert extension in collector["extensions"]
    for kind in ("receivers", "processors", "exporters"):  # and nothing is defined but unused
        used = {c for p in collector["service"]["pipelines"].values() for c in p.get(kind, [])}
        assert set(collector[kind]) == used, kind


def test_collector_fans_traces_out_to_jaeger_tempo_and_the_tuner(collector, compose):
    pipelines = collector["service"]["pipelines"]
    trace_exporters = {e for name, p in pipelines.items() if name.split("/")[0] == "traces" for e in p["exporters"]}
    endpoints = {collector["exporters"][e]["endpoint"] for e in trace_exporters}
    assert "jaeger:4317" in endpoints and "tempo:4317" in endpoints
    assert "${env:TUNER_OTLP_ENDPOINT}" in endpoints
    tuner_default = compose["services"]["otel-collector"]["environment"]["TUNER_OTLP_ENDPOINT"]
    assert tuner_default.endswith(":-host.docker.internal:4327}")
    assert any("host.docker.internal:host-gateway" in h for h in compose["services"]["otel-collector"]["extra_hosts"])


def test_the_tuner_pipeline_drops_only_what_the_tuner_ignores(collector):
    conditions = collector["processors"]["filter/request_spans"]["traces"]["span"]
    assert f'name == "{a.VERIFY_SPAN_NAME}"' in conditions
    assert not any("text_completion" in c for c in conditions)  # request spans must pass


def test_tempo_receives_otlp_grpc_where_the_collector_sends(collector):
    tempo = load_yaml("tempo.yaml")
    assert port_of(tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]) == \
        port_of(collector["exporters"]["otlp/tempo"]["endpoint"])


def test_prometheus_scrapes_the_collectors_prometheus_exporter(collector):
    prometheus = load_yaml("prometheus.yml")
    targets = [t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert f"otel-collector:{port_of(collector['exporters']['prometheus']['endpoint'])}" in targets
    assert "metrics" in collector["service"]["pipelines"]
    assert "prometheus" in collector["service"]["pipelines"]["metrics"]["exporters"]


def test_prometheus_config_passes_the_real_prometheus_checker():
    """promtool (from the prometheus package) parses the file with Prometheus' own config loader, which
    refuses unknown keys and bad durations that yaml.safe_load lets through."""
    promtool = shutil.which("promtool")
    if promtool is None:
        missing("promtool", "apt-get install prometheus; scripts/setup_venv.sh test does it")
    result = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_datasources_point_at_compose_services(compose):
    datasources = load_yaml("grafana/provisioning/datasources/datasources.yaml")["datasources"]
    by_type = {d["type"]: d for d in datasources}
    assert {"prometheus", "tempo"} <= set(by_type)
    for d in datasources:
        host, port = re.match(r"http://([^:/]+):(\d+)", d["url"]).groups()
        assert host in compose["services"], d["name"]
    providers = load_yaml("grafana/provisioning/dashboards/dashboards.yaml")["providers"]
    mounts = [v.split(":")[1] for v in compose["services"]["grafana"]["volumes"]]
    assert all(p["options"]["path"] in mounts for p in providers)


# ------------------------------------------------------------------------------ dashboard
def targets(dashboard: dict) -> list[dict]:
    return [t for p in dashboard["panels"] for t in p.get("targets", [])]


def promql(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for t in targets(dashboard) if "expr" in t]
    return exprs + [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]


ALL_METRICS = (*a.ALL_METRICS, *a.TUNER_METRICS)  # the server's (EP included) and the continuous tuner's
EMITTED_SERIES = {s for spec in ALL_METRICS for s in a.prometheus_series(spec)}
EMITTED_LABELS = {a.prometheus_label(k) for spec in ALL_METRICS for k in spec.attributes} | {"le"}
# Identifiers in PromQL that are neither metrics nor labels.
PROMQL_WORDS = {"sum", "by", "rate", "histogram_quantile", "label_values", "le", "without", "avg", "max", "min",
                "increase"}


def test_dashboard_json_loads_and_uses_provisioned_datasources(dashboard):
    uids = {d["uid"] for d in load_yaml("grafana/provisioning/datasources/datasources.yaml")["datasources"]}
    assert dashboard["uid"] and dashboard["panels"]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] in uids, panel["title"]
            assert all(t["datasource"]["uid"] in uids for t in panel["targets"]), panel["title"]


def test_dashboard_queries_name_only_emitted_metrics_and_labels(dashboard):
    exprs = promql(dashboard)
    assert exprs
    for expr in exprs:
        # Drop label values ("...") and Grafana variables ($x), then classify every identifier.
        bare = re.sub(r'"[^"]*"', '""', expr)
        bare = re.sub(r"\$\w+", "", bare)
        bare = re.sub(r"\[\d+[smhd]\]", "", bare)  # range durations such as [10m]
        for word in re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*", bare):
            if word in PROMQL_WORDS:
                continue
            assert word in EMITTED_SERIES or word in EMITTED_LABELS or word in {
                a.prometheus_name(spec) for spec in ALL_METRICS}, f"{word!r} in {expr}"


def test_dashboard_shows_unique_experts_by_layer_acceptance_and_cost_by_policy(dashboard):
    text = "\n".join(promql(dashboard))
    layer, policy = a.prometheus_label(a.MOE_LAYER), a.prometheus_label(a.SPEC_POLICY_ID)
    unique = a.prometheus_name(a.STEP_UNIQUE_EXPERTS)
    assert re.search(rf"by \([^)]*{layer}[^)]*\) \(rate\({unique}_sum", text)
    assert f"{a.prometheus_name(a.STEP_ACCEPTED_TOKENS)}_sum" in text and a.prometheus_name(a.DRAFTED_TOKENS) in text
    per_token = (rf"sum by \({policy}\) \(rate\({a.prometheus_name(a.STEP_SECONDS)}_sum[^)]*\)\) / "
                 rf"sum by \({policy}\) \(rate\({a.prometheus_name(a.COMMITTED_TOKENS)}")
    assert re.search(per_token, text)
    for spec in (a.REQUEST_DURATION, a.TIME_TO_FIRST_TOKEN, a.TIME_PER_OUTPUT_TOKEN):
        assert f"{a.prometheus_name(spec)}_bucket" in text


def test_dashboard_traceql_names_real_span_attributes(dashboard):
    queries = [t["query"] for t in targets(dashboard) if t.get("queryType") == "traceql"]
    assert queries
    known = set(a.REQUEST_SPAN_KEYS) | set(a.VERIFY_SPAN_KEYS)
    for query in queries:
        for attribute in re.findall(r"span\.([a-z_.]+)", query):
            assert attribute in known, attribute


def test_readme_traceql_examples_name_real_span_attributes():
    readme = (DEPLOY / "README.md").read_text()
    attributes = re.findall(r"span\.(moespec\.[a-z_.]+)", readme)
    assert a.SPEC_POLICY_ID in attributes
    assert set(attributes) <= set(a.REQUEST_SPAN_KEYS) | set(a.VERIFY_SPAN_KEYS)


def test_dashboard_shows_the_continuous_tuners_incumbent_and_decisions(dashboard, compose):
    text = "\n".join(promql(dashboard))
    assert a.prometheus_name(a.TUNER_INCUMBENT) == "moespec_tuner_incumbent_seconds"
    assert re.search(rf"by \([^)]*{a.prometheus_label(a.TUNER_POLICY)}[^)]*\) \(moespec_tuner_incumbent_seconds\)",
                     text)
    assert f"by ({a.prometheus_label(a.TUNER_DECISION)}) (increase({a.prometheus_name(a.TUNER_DECISIONS)}" in text
    # The compose tuner runs continuously and sends its metrics to the Collector's OTLP receiver.
    tuner = compose["services"]["tuner"]
    assert "--continuous" in tuner["command"]
    assert port_of(tuner["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]) == 4317
