"""The Grafana dashboard against a real Prometheus scraping a real `moespec serve --prometheus-port`.

Every PromQL query of deploy/grafana/dashboards/moespec.json (read from the file, so panels added
later are covered without touching this test) and every Prometheus-backed template variable is
executed through Prometheus' HTTP API after real requests under three draft policies. Each query
must return series carrying exactly the labels its `by (...)` clause promises, with every layer and
every policy that had traffic, and numbers that mean what the panel says (checked against the
server's own responses for the panels whose meaning is known here).

The compose stack has Prometheus scrape the Collector's `prometheus` exporter instead of the server;
both apply the same OpenTelemetry -> Prometheus naming rules (see otel/attributes.py).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from otel import attributes as a
from otel.receiver import OtlpTraceReceiver
from service.server.client import MoespecClient
from service.types import Drafter, DraftPolicy, GenerationRequest, SamplingParams
from tests.support.real_backends import free_port, http_json, start_prometheus, wait_until
from tuner.drivers.loadgen import DEFAULT_PROMPTS, load_prompts
from tuner.drivers.server_proc import start_server

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/moespec.json"
TOKEN = "prometheus-test-token"
PLAIN = DraftPolicy(Drafter.MODEL, 0, policy_id="prom-plain")
POLICIES = (PLAIN, DraftPolicy(Drafter.MODEL, 2, 0.0, policy_id="prom-model-2"),
            DraftPolicy(Drafter.NGRAM, 3, policy_id="prom-ngram-3"))
REQUESTS_PER_POLICY = 3
# Grafana's interval macros all become the window over the measured traffic (see `Scraped`).
MACROS = ("$__rate_interval", "$__interval", "$__range")
POLICY_LABEL = a.prometheus_label(a.SPEC_POLICY_ID)
LAYER_LABEL = a.prometheus_label(a.MOE_LAYER)
AGGREGATIONS = ("sum", "avg", "min", "max", "count")


# ------------------------------------------------------------ reading the dashboard
def walk_panels(panels: list[dict]):
    for panel in panels:
        yield panel
        yield from walk_panels(panel.get("panels", []))  # collapsed rows nest their panels


def prometheus_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title / refId, expr) for every Prometheus target."""
    out = []
    for panel in walk_panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            source = target.get("datasource") or panel.get("datasource") or {}
            if source.get("type") == "prometheus" and target.get("expr"):
                out.append((f"{panel['title']} [{target.get('refId', '?')}]", target["expr"]))
    return out


# The continuous tuner's panels read metrics the tuner process exports (through the Collector in the
# deploy stack), not the server: their names and labels are checked against otel.attributes in
# test_deploy_configs; here only the server's panels run against the live Prometheus.
TUNER_SERIES = {s for spec in a.TUNER_METRICS for s in a.prometheus_series(spec)}


def server_queries(dashboard: dict) -> list[tuple[str, str]]:
    return [(title, expr) for title, expr in prometheus_queries(dashboard)
            if not any(name in expr for name in TUNER_SERIES)]


def prometheus_variables(dashboard: dict) -> list[dict]:
    return [v for v in dashboard.get("templating", {}).get("list", [])
            if v.get("type") == "query" and (v.get("datasource") or {}).get("type") == "prometheus"]


def expand(expr: str, variables: dict[str, str], window: str) -> str:
    for macro in MACROS:
        expr = expr.replace(macro, window)
    for name, value in variables.items():
        expr = re.sub(rf"\$\{{{name}\}}|\${name}\b", value, expr)
    assert "$" not in expr, f"unknown Grafana variable left in {expr}"
    return expr


def promised_labels(expr: str) -> set[str] | None:
    """The label set a query's results carry: its `by (...)` labels (without `le`, which
    histogram_quantile consumes); {} for a bare aggregation; None when the query does not say."""
    clauses = re.findall(r"\bby\s*\(([^)]*)\)", expr)
    if clauses:
        labels = [{label.strip() for label in c.split(",") if label.strip()} for c in clauses]
        if "histogram_quantile" in expr:
            labels = [group - {"le"} for group in labels]
        assert all(group == labels[0] for group in labels), f"the two sides group differently: {expr}"
        return labels[0]
    if re.match(rf"\s*({'|'.join(AGGREGATIONS)})\s*\(", expr):
        return set()
    return None


# ------------------------------------------------------------ the stack
@dataclass
class Scraped:
    """Prometheus after the traffic, and how the dashboard's queries are evaluated on it.

    A counter series that first appears already at its final value shows no increase to rate(), so
    each policy's series are made by a warm-up request and scraped before the measured traffic. The
    queries are evaluated at the last scrape (`end`) with every rate window reaching back to 1 ms
    before the scrape taken between warm-up and traffic (`start`). Prometheus extrapolates a rate to
    the window's edges; with samples at both edges that extrapolation is 1 ms in `end - start`, so
    each rate is the measured traffic's increase over the same interval, for every series alike."""

    url: str
    num_layers: int
    start: float = 0.0  # sample timestamps (s), see above
    end: float = 0.0
    totals: dict[str, dict[str, float]] = field(default_factory=dict)  # policy -> measured responses' sums

    def window(self) -> str:
        return f"{round((self.end - self.start) * 1000) + 1}ms"

    def run(self, expr: str, variables: dict[str, str], at: float | None = None) -> list[dict]:
        at = self.end if at is None else at
        reply = http_json(f"{self.url}/api/v1/query", {"query": expand(expr, variables, self.window()),
                                                       "time": f"{at:.3f}"})
        assert reply["status"] == "success", reply
        assert reply["data"]["resultType"] == "vector", expr
        return reply["data"]["result"]

    def committed_by_policy(self) -> dict[str, float]:
        expr = f"sum by ({POLICY_LABEL}) ({a.prometheus_name(a.COMMITTED_TOKENS)})"
        return {s["metric"][POLICY_LABEL]: float(s["value"][1]) for s in self.run(expr, {}, at=time.time())}

    def last_scrape(self) -> float:
        (s,) = self.run(f"max(timestamp({a.prometheus_name(a.COMMITTED_TOKENS)}))", {}, at=time.time())
        return float(s["value"][1])


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("prometheus")
    metrics_port = free_port()
    with OtlpTraceReceiver() as receiver:  # traces on, so the dropped-span counter exists too
        env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint, "OTEL_TRACES_EXPORTER": "otlp",
               "OTEL_METRICS_EXPORTER": "none", "OTEL_BSP_SCHEDULE_DELAY": "200"}
        server = start_server(env, TOKEN, ("--threads", "1", "--ep-size", "4", "--prometheus-host", "127.0.0.1",
                                           "--prometheus-port", str(metrics_port)))
        prometheus = None
        try:
            prometheus, url = start_prometheus(workdir, [f"127.0.0.1:{metrics_port}"], scrape_interval="1s")
            wait_until(lambda: all(t["health"] == "up" for t in
                                   http_json(f"{url}/api/v1/targets")["data"]["activeTargets"]),
                       timeout=30, what="the server's /metrics scraped")
            with MoespecClient(server.address, admin_token=TOKEN) as client:
                client.wait_ready(timeout=60)
                state = Scraped(url, client.model_info().num_layers)
                warm = drive(client, requests=1, max_new_tokens=4)
                wait_until(lambda: state.committed_by_policy() == totals_of(warm, "committed_tokens"),
                           timeout=30, what="Prometheus holding the warm-up")
                time.sleep(2.5)  # two more scrapes at the warm-up values
                state.start = state.last_scrape()
                state.totals = drive(client, requests=REQUESTS_PER_POLICY, max_new_tokens=24)
            final = {p: warm[p]["committed_tokens"] + t["committed_tokens"] for p, t in state.totals.items()}
            wait_until(lambda: state.committed_by_policy() == final, timeout=30,
                       what="Prometheus holding every committed token")
            time.sleep(2.5)
            state.end = state.last_scrape()
            yield state
        finally:
            if prometheus is not None:
                prometheus.stop()
            server.stop()


def totals_of(totals: dict[str, dict[str, float]], key: str) -> dict[str, float]:
    return {policy: t[key] for policy, t in totals.items()}


def drive(client: MoespecClient, requests: int, max_new_tokens: int) -> dict[str, dict[str, float]]:
    """Real requests under each policy -> what the responses say, summed per policy id."""
    prompts = load_prompts(DEFAULT_PROMPTS)
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for policy in POLICIES:
        client.set_policy(policy)
        for prompt in prompts[:requests]:
            reply = client.generate(GenerationRequest(prompt=prompt, max_new_tokens=max_new_tokens,
                                                      sampling=SamplingParams(temperature=0)))
            spec, t = reply.spec, totals[policy.policy_id]
            assert spec.policy_id == policy.policy_id
            for key in ("drafted_tokens", "accepted_tokens", "committed_tokens", "verify_steps",
                        "draft_seconds", "verify_seconds"):
                t[key] += getattr(spec, key)
            for layer, mean in enumerate(spec.unique_experts_mean):  # per-request mean -> sum over its steps
                t[f"unique_experts_{layer}"] += mean * spec.verify_steps
    return {k: dict(v) for k, v in totals.items()}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


# ------------------------------------------------------------ the checks
def check_series(expr: str, series: list[dict], num_layers: int, policies: set[str]) -> None:
    """The series of one executed query carry the labels and values the panel promises."""
    assert series, f"no series for {expr}"
    promised = promised_labels(expr)
    for s in series:
        labels = {k: v for k, v in s["metric"].items() if k != "__name__"}
        if promised is not None:
            assert set(labels) == promised, f"labels {sorted(labels)} != promised {sorted(promised)} in {expr}"
        assert all(labels.values()), f"empty label value {labels} in {expr}"
        value = float(s["value"][1])
        # A ratio of rates is NaN only where its denominator is 0: plain decoding drafts nothing.
        assert math.isfinite(value) or labels.get(POLICY_LABEL) == PLAIN.policy_id, f"{value} for {labels} in {expr}"
    if promised and LAYER_LABEL in promised:
        assert {s["metric"][LAYER_LABEL] for s in series} >= {str(i) for i in range(num_layers)}, expr
    if promised and POLICY_LABEL in promised:
        assert {s["metric"][POLICY_LABEL] for s in series} == policies, expr


def test_only_the_tuner_panels_are_left_out_of_the_live_check(dashboard):
    served = server_queries(dashboard)
    left_out = [expr for title, expr in prometheus_queries(dashboard) if (title, expr) not in served]
    assert left_out and all("moespec_tuner_" in expr for expr in left_out), left_out


def test_the_dashboard_has_prometheus_queries_to_run(dashboard):
    queries = prometheus_queries(dashboard)
    assert len(queries) >= 10 and prometheus_variables(dashboard)
    assert all(promised_labels(expr) is not None for _, expr in queries), "a query whose labels cannot be checked"


def test_every_dashboard_query_returns_the_series_its_panel_expects(scraped, dashboard):
    # Every variable at "All", as the dashboard opens.
    variables = {v["name"]: v.get("allValue") or ".*" for v in prometheus_variables(dashboard)}
    for _, expr in server_queries(dashboard):
        check_series(expr, scraped.run(expr, variables), scraped.num_layers, set(scraped.totals))


@pytest.mark.parametrize("policy", [p.policy_id for p in POLICIES])
def test_the_policy_variable_narrows_every_query_to_that_policy(scraped, dashboard, policy):
    for _, expr in server_queries(dashboard):
        if "$policy" in expr:
            check_series(expr, scraped.run(expr, {"policy": policy}), scraped.num_layers, {policy})


def test_template_variables_list_every_policy_with_traffic(scraped, dashboard):
    for variable in prometheus_variables(dashboard):
        definition = variable.get("definition") or variable["query"]["query"]
        m = re.fullmatch(r"label_values\(\s*([^,]+?)\s*,\s*(\w+)\s*\)", definition)
        assert m, f"the test knows only label_values(metric, label); extend it for {definition!r}"
        metric, label = m.groups()
        values = http_json(f"{scraped.url}/api/v1/label/{label}/values", {"match[]": metric})["data"]
        assert set(values) == set(scraped.totals), definition


def panel_value(scraped: Scraped, dashboard: dict, title: str, labels: dict[str, str]) -> float:
    (expr,) = [e for t, e in prometheus_queries(dashboard) if t.startswith(title)]
    series = scraped.run(expr, {"policy": ".*"})
    (s,) = [s for s in series if all(s["metric"].get(k) == v for k, v in labels.items())]
    return float(s["value"][1])


def test_panel_numbers_match_what_the_responses_reported(scraped, dashboard):
    """Each ratio of rates over the window is the ratio of the measured traffic's totals (the 1 ms
    extrapolation at the window's start is the only difference: 1e-3 covers it)."""
    for policy in POLICIES[1:]:
        t = scraped.totals[policy.policy_id]
        by_policy = {POLICY_LABEL: policy.policy_id}
        acceptance = panel_value(scraped, dashboard, "Acceptance rate by policy", by_policy)
        assert acceptance == pytest.approx(t["accepted_tokens"] / t["drafted_tokens"], rel=1e-3)
        per_step = panel_value(scraped, dashboard, "Accepted tokens per verify step", by_policy)
        assert per_step == pytest.approx(t["accepted_tokens"] / t["verify_steps"], rel=1e-3)
        per_token = panel_value(scraped, dashboard, "Seconds per committed token", by_policy)
        assert per_token == pytest.approx((t["draft_seconds"] + t["verify_seconds"]) / t["committed_tokens"],
                                          rel=1e-3)
    steps = sum(t["verify_steps"] for t in scraped.totals.values())
    for layer in range(scraped.num_layers):
        mean = panel_value(scraped, dashboard, "Unique experts per verify step, by layer (mean)",
                           {LAYER_LABEL: str(layer)})
        assert mean == pytest.approx(sum(t[f"unique_experts_{layer}"] for t in scraped.totals.values()) / steps,
                                     rel=1e-3)


def test_the_check_rejects_queries_a_wrong_dashboard_would_hold(scraped, dashboard):
    """Negative controls: the same check on a misspelt label, a misspelt metric and a filter on a label
    the metric does not carry must fail (and passes on the query as it is)."""
    expr = next(e for _, e in prometheus_queries(dashboard) if LAYER_LABEL in e and "$policy" in e)
    wrong = {
        "label": expr.replace(LAYER_LABEL, "moespec_layer"),
        "metric": expr.replace(a.prometheus_name(a.STEP_UNIQUE_EXPERTS), "moespec_moe_unique_experts"),
        "filter": expr.replace(POLICY_LABEL + "=~", "moespec_policy_id=~"),
    }
    policy = POLICIES[1].policy_id
    check_series(expr, scraped.run(expr, {"policy": policy}), scraped.num_layers, {policy})
    for bad in wrong.values():
        assert bad != expr
        with pytest.raises(AssertionError):
            check_series(bad, scraped.run(bad, {"policy": policy}), scraped.num_layers, {policy})
