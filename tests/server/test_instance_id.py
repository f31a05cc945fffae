"""A server's replica identity: which id `moespec serve` picks, and that its telemetry resource
carries it as `service.instance.id` (what a fleet tuner scopes its spans by). GetModelInfo over real
gRPC is checked in tests/test_fleet_postgres.py against real `moespec serve` processes."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest

from otel import attributes as attr
from otel.config import TelemetryConfig
from otel.setup import build_resource
from service.cli.serve import instance_id
from service.errors import UsageError
from tests.telemetry.test_otel_config import INFO


def test_the_flag_wins_over_the_resource_attributes_and_a_uuid_is_the_last_resort():
    assert instance_id("replica-a", {"service.instance.id": "from-env"}) == "replica-a"
    assert instance_id(None, {"service.instance.id": "from-env"}) == "from-env"
    first, second = instance_id(None, {}), instance_id(None, {})
    assert uuid.UUID(first) and first != second  # a fresh one per start


@pytest.mark.parametrize("flag", ["", "   "])
def test_an_empty_instance_id_is_refused(flag):
    with pytest.raises(UsageError, match="--instance-id must not be empty"):
        instance_id(flag, {})


def test_the_resource_carries_the_instance_id_even_over_otel_resource_attributes():
    config = TelemetryConfig(resource_attributes=(("service.instance.id", "stale"),))
    resource = build_resource(config, replace(INFO, instance_id="replica-b"))
    assert resource.attributes[attr.RESOURCE_SERVICE_INSTANCE_ID] == "replica-b"
    assert attr.RESOURCE_SERVICE_INSTANCE_ID not in build_resource(TelemetryConfig(), INFO).attributes
