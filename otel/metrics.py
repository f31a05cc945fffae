"""The metric instruments and how one finished request is recorded into them.

Recorded after the request from its StepRecords (never from the engine thread). Every verify step
is counted: metrics are not sampled, only verify spans are. The per-step and per-pass histograms
take a request's values per series in one call (otel.aggregate): the same data points as one
measurement per step, without the SDK's per-measurement cost on the request's path.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel import attributes as a
from otel.aggregate import BatchedHistogram
from otel.deferred import DeferredMeasurements
from service.types import BatchPassRecord, DraftPolicy, GenerationResult, ModelInfo, StepRecord


def unique_expert_buckets(info: ModelInfo) -> tuple[float, ...]:
    """From m (one position) to the widest possible window, in steps of m/2 (at most ~32 buckets)."""
    m, top = max(1, info.top_k), min(info.num_experts, (info.max_draft_length + 1) * max(1, info.top_k))
    step = max(1, m // 2, (top - m) // 32)
    return tuple(float(b) for b in range(m, top + 1, step))


def ep_rank_buckets(info: ModelInfo) -> tuple[float, ...]:
    """One bucket per rank count up to 64 ranks (an EP size above the experts would be meaningless)."""
    return tuple(float(r) for r in range(1, min(64, max(1, info.num_experts)) + 1))


def rank_expert_buckets(info: ModelInfo) -> tuple[float, ...]:
    """Experts on one rank: from 1 to E, at most ~32 buckets."""
    top = max(1, info.num_experts)
    return tuple(float(b) for b in range(1, top + 1, max(1, top // 32)))


def batch_unique_expert_buckets(info: ModelInfo) -> tuple[float, ...]:
    """A batch pass can touch every expert: from m to E, at most ~32 buckets."""
    m, top = max(1, info.top_k), max(1, info.num_experts)
    step = max(1, m // 2, (top - m) // 32)
    return tuple(float(b) for b in range(m, top + 1, step))


def accepted_token_buckets(info: ModelInfo) -> tuple[float, ...]:
    return tuple(float(k) for k in range(info.max_draft_length + 1))  # one bucket per count


def per_layer(rows: Iterable[Sequence[int] | None]) -> list[list[int]]:
    """Per-step (or per-pass) [L] tuples -> one list of values per layer, in row order; None rows
    (the EP fields without --ep-size) contribute nothing."""
    layers: list[list[int]] = []
    for row in rows:
        if row is None:
            continue
        layers.extend([] for _ in range(len(row) - len(layers)))
        for layer, value in enumerate(row):
            layers[layer].append(value)
    return layers


def drafted_by_cell(steps: Iterable[StepRecord]) -> dict[str, list[int]]:
    """A table policy's steps name their cell on the drafted histogram ("": the base policy)."""
    cells: defaultdict[str, list[int]] = defaultdict(list)
    for step in steps:
        cells[step.cell].append(step.drafted)
    return cells


class Instruments:
    """`batched`: the meter provider has otel.aggregate's view and it works (otel.setup decides);
    the per-step and per-pass histograms then take a whole request's (or report's) values per call.
    `deferred` (needs `batched`; otel.setup checks it works): every value waits in
    otel.deferred until the next collection, so the request's thread never calls the SDK."""

    def __init__(self, meter: Meter, info: ModelInfo, dropped_spans: Callable[[], int] | None = None, *,
                 batched: bool = False, deferred: bool = False):
        self.batched = batched
        pending = DeferredMeasurements(meter) if batched and deferred else None
        self.deferred = pending is not None

        def histogram(spec: a.MetricSpec, buckets: tuple[float, ...] | None = None):
            return meter.create_histogram(spec.name, unit=spec.unit, description=spec.description,
                                          explicit_bucket_boundaries_advisory=list(buckets or spec.buckets))

        def many(spec: a.MetricSpec, buckets: tuple[float, ...] | None = None):
            values = BatchedHistogram(histogram(spec, buckets), batched)
            return pending.histogram(values) if pending is not None else values

        def counter(spec: a.MetricSpec):
            sdk_counter = meter.create_counter(spec.name, unit=spec.unit, description=spec.description)
            return pending.counter(sdk_counter) if pending is not None else sdk_counter

        # Once per request (a list of one value, so that they can wait too).
        self.request_duration = many(a.REQUEST_DURATION)
        self.time_to_first_token = many(a.TIME_TO_FIRST_TOKEN)
        self.time_per_output_token = many(a.TIME_PER_OUTPUT_TOKEN)
        self.rule_calibration = many(a.RULE_CALIBRATION_ERROR)
        self.drafted = counter(a.DRAFTED_TOKENS)
        self.committed = counter(a.COMMITTED_TOKENS)
        self.ep_dispatch_bytes = counter(a.EP_DISPATCH_BYTES)
        # Once per step or pass (per layer for some): a request's values at a time.
        self.step_accepted = many(a.STEP_ACCEPTED_TOKENS, accepted_token_buckets(info))
        self.step_drafted = many(a.STEP_DRAFTED_TOKENS, accepted_token_buckets(info))
        self.step_unique = many(a.STEP_UNIQUE_EXPERTS, unique_expert_buckets(info))
        self.step_cost = many(a.STEP_DECODE_STEP_EQUIVALENTS)
        self.step_seconds = many(a.STEP_SECONDS)
        self.step_ep_ranks = many(a.STEP_EP_RANKS_TOUCHED, ep_rank_buckets(info))
        self.batch_unique = many(a.BATCH_UNIQUE_EXPERTS, batch_unique_expert_buckets(info))
        self.batch_size = many(a.BATCH_SIZE_METRIC)
        self.batch_ep_ranks = many(a.BATCH_EP_RANKS_TOUCHED, ep_rank_buckets(info))
        self.batch_ep_max_rank = many(a.BATCH_EP_MAX_RANK_EXPERTS, rank_expert_buckets(info))
        self._batch_layers = [{a.MOE_LAYER: i} for i in range(info.num_layers)]
        if dropped_spans is not None:
            def observe(_: CallbackOptions) -> Iterable[Observation]:
                return [Observation(dropped_spans())]

            meter.create_observable_counter(a.DROPPED_SPANS.name, [observe], unit=a.DROPPED_SPANS.unit,
                                            description=a.DROPPED_SPANS.description)
        self.gen_ai_attributes = {
            a.GEN_AI_OPERATION_NAME: a.GEN_AI_OPERATION,
            a.GEN_AI_PROVIDER_NAME: a.GEN_AI_PROVIDER,
            a.GEN_AI_REQUEST_MODEL: info.model_name,
        }

    def record_request(self, result: GenerationResult, duration_s: float, policy: DraftPolicy) -> None:
        base = self.gen_ai_attributes
        self.request_duration.record([duration_s], base)
        self.time_to_first_token.record([result.time_to_first_token], base)
        if result.completion_tokens > 1:
            tpot = (result.seconds - result.time_to_first_token) / (result.completion_tokens - 1)
            self.time_per_output_token.record([max(0.0, tpot)], base)
        self.record_steps(result.steps, policy)

    def record_batch_passes(self, records: Sequence[BatchPassRecord]) -> None:
        """Once per pass (otel.batch calls it with the passes one report completed), not per request."""
        self.batch_size.record([r.batch_size for r in records], None)
        for layer_attrs, values in zip(self._batch_layers, per_layer(r.unique_experts for r in records),
                                       strict=False):
            self.batch_unique.record(values, layer_attrs)
        for layer_attrs, values in zip(self._batch_layers, per_layer(r.ep_ranks_touched for r in records),
                                       strict=False):
            self.batch_ep_ranks.record(values, layer_attrs)
        for layer_attrs, values in zip(self._batch_layers, per_layer(r.ep_max_rank_experts for r in records),
                                       strict=False):
            self.batch_ep_max_rank.record(values, layer_attrs)

    def record_failure(self, duration_s: float, error_type: str) -> None:
        self.request_duration.record([duration_s], {**self.gen_ai_attributes, a.ERROR_TYPE: error_type})

    def record_steps(self, steps: Sequence[StepRecord], policy: DraftPolicy) -> None:
        """One call per series for the whole request; each step still counts once in each histogram."""
        attrs = {a.SPEC_POLICY_ID: policy.policy_id, a.SPEC_DRAFTER: policy.drafter.value,
                 a.SPEC_DRAFT_LENGTH: policy.draft_length}
        self.step_accepted.record([s.accepted for s in steps], attrs)
        for cell, drafted in drafted_by_cell(steps).items():
            self.step_drafted.record(drafted, {**attrs, a.SPEC_CELL: cell} if cell else attrs)
        self.step_cost.record([s.decode_step_equivalents for s in steps], attrs)
        self.step_seconds.record([s.seconds for s in steps], attrs)
        for layer, values in enumerate(per_layer(s.unique_experts for s in steps)):
            self.step_unique.record(values, {**attrs, a.MOE_LAYER: layer})
        for layer, values in enumerate(per_layer(s.ep_ranks_touched for s in steps)):  # only with --ep-size
            self.step_ep_ranks.record(values, {**attrs, a.MOE_LAYER: layer})
        self._record_totals(steps, attrs)

    def _record_totals(self, steps: Sequence[StepRecord], attrs: dict) -> None:
        # Added even when 0 so every policy has both series (acceptance = accepted / drafted).
        self.drafted.add(sum(s.drafted for s in steps), attrs)
        self.committed.add(sum(s.committed for s in steps), attrs)
        predicted = [s for s in steps if s.predicted_accepted is not None and s.drafted]  # the rule's steps
        if predicted:
            # A histogram takes non-negative values only: the size of the error, its sign in the spans' counts.
            error = sum(s.predicted_accepted for s in predicted) - sum(s.accepted for s in predicted)
            self.rule_calibration.record([abs(error) / sum(s.drafted for s in predicted)], attrs)
        ep = [s.ep_dispatch_bytes for s in steps if s.ep_ranks_touched is not None]  # only with --ep-size
        if ep:
            self.ep_dispatch_bytes.add(sum(ep), attrs)
