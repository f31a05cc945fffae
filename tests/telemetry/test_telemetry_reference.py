"""docs/telemetry.md's reference tables say exactly what otel/attributes.py defines: every span
attribute (and when it is emitted), every resource attribute, every metric with its kind, unit and
attributes. The tables are parsed, not regenerated, so a hand edit that drifts fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from otel import attributes as a

DOC = Path(__file__).resolve().parents[2] / "docs" / "telemetry.md"
ALWAYS, EP, TUNER, RULE = "always", "`--ep-size`", "`moespec tune --continuous`", "controller `moespec`"
TABLE = "a table policy's cell ran the step"
TREE_POLICY, TREE_REQUEST, TREE_STEP = "a tree policy", "a step drafted a tree", "the step drafted a tree"
REQUEST, VERIFY, BATCH = a.request_span_name("{model}"), a.VERIFY_SPAN_NAME, a.VERIFY_BATCH_SPAN_NAME


def table(text: str, heading: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table after `### heading`."""
    section = text.split(f"### {heading}\n", 1)[1]
    rows = []
    for line in section.splitlines():
        if line.startswith("#"):
            break
        if line.startswith("|") and not set(line) <= set("|-"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows[1:]  # the header row


def names(cell: str) -> tuple[str, ...]:
    return tuple(re.findall(r"`([^`]+)`", cell))


def documented_spans(text: str) -> set[tuple[str, str, str]]:
    return {(names(span)[0], names(key)[0], when) for span, key, when in table(text, "Spans and their attributes")}


def expected_spans() -> set[tuple[str, str, str]]:
    groups = ((REQUEST, a.REQUEST_SPAN_KEYS, ALWAYS), (REQUEST, a.EP_REQUEST_SPAN_KEYS, EP),
              (VERIFY, a.VERIFY_SPAN_KEYS, ALWAYS), (VERIFY, a.EP_VERIFY_SPAN_KEYS, EP),
              (VERIFY, a.TABLE_VERIFY_SPAN_KEYS, TABLE),
              (REQUEST, a.TREE_POLICY_REQUEST_SPAN_KEYS, TREE_POLICY),
              (REQUEST, a.TREE_REQUEST_SPAN_KEYS, TREE_REQUEST),
              (VERIFY, a.TREE_VERIFY_SPAN_KEYS, TREE_STEP),
              (BATCH, a.VERIFY_BATCH_SPAN_KEYS, ALWAYS), (BATCH, a.EP_VERIFY_BATCH_SPAN_KEYS, EP))
    return {(span, key, when) for span, keys, when in groups for key in keys}


def documented_metrics(text: str) -> set[tuple]:
    return {(names(name)[0], kind, names(unit)[0], names(attrs), when)
            for name, kind, unit, attrs, when in table(text, "Metrics")}


def expected_metrics() -> set[tuple]:
    groups = ((a.METRICS, ALWAYS), (a.EP_METRICS, EP), (a.TUNER_METRICS, TUNER), (a.RULE_METRICS, RULE))
    return {(s.name, s.kind.value, s.unit, s.attributes, when) for specs, when in groups for s in specs}


RESOURCE = {a.RESOURCE_SERVICE_NAME, a.RESOURCE_MODEL_NAME, a.RESOURCE_DRAFT_MODEL_NAME, a.RESOURCE_BACKEND,
            a.RESOURCE_DEVICE}


@pytest.fixture(scope="module")
def doc() -> str:
    return DOC.read_text()


def test_the_span_table_is_every_span_attribute_the_service_emits(doc):
    assert documented_spans(doc) == expected_spans()


def test_the_metric_table_is_every_metric_with_its_kind_unit_and_attributes(doc):
    assert documented_metrics(doc) == expected_metrics()


def test_the_resource_table_is_every_resource_attribute(doc):
    assert {names(row[0])[0] for row in table(doc, "Resource attributes")} == RESOURCE


def test_a_drifted_table_is_caught(doc):
    """The negative control: the same doc with one metric's unit and one span key renamed."""
    row = "| `moespec.batch.size` | histogram | "
    drifted = doc.replace(row + "`{request}` |", row + "`1` |")
    drifted = drifted.replace("| `verify` | `moespec.moe.widest_layer` |", "| `verify` | `moespec.moe.widest` |")
    assert drifted != doc
    assert documented_metrics(drifted) != expected_metrics()
    assert documented_spans(drifted) != expected_spans()
