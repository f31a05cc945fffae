"""The metric instruments and how one finished request is recorded into them.

Recorded after the request from its StepRecords (never from the engine thread). Every verify step
is counted: metrics are not sampled, only verify spans are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from otel import attributes as a
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


class Instruments:
    def __init__(self, meter: Meter, info: ModelInfo, dropped_spans: Callable[[], int] | None = None):
        def histogram(spec: a.MetricSpec, buckets: tuple[float, ...] | None = None):
            return meter.create_histogram(spec.name, unit=spec.unit, description=spec.description,
                                          explicit_bucket_boundaries_advisory=list(buckets or spec.buckets))

        def counter(spec: a.MetricSpec):
            return meter.create_counter(spec.name, unit=spec.unit, description=spec.description)

        self.request_duration = histogram(a.REQUEST_DURATION)
        self.time_to_first_token = histogram(a.TIME_TO_FIRST_TOKEN)
        self.time_per_output_token = histogram(a.TIME_PER_OUTPUT_TOKEN)
        self.step_accepted = histogram(a.STEP_ACCEPTED_TOKENS, accepted_token_buckets(info))
        self.step_drafted = histogram(a.STEP_DRAFTED_TOKENS, accepted_token_buckets(info))
        self.rule_calibration = histogram(a.RULE_CALIBRATION_ERROR)
        self.step_unique = histogram(a.STEP_UNIQUE_EXPERTS, unique_expert_buckets(info))
        self.step_cost = histogram(a.STEP_DECODE_STEP_EQUIVALENTS)
        self.step_seconds = histogram(a.STEP_SECONDS)
        self.drafted = counter(a.DRAFTED_TOKENS)
        self.committed = counter(a.COMMITTED_TOKENS)
        self.step_ep_ranks = histogram(a.STEP_EP_RANKS_TOUCHED, ep_rank_buckets(info))
        self.ep_dispatch_bytes = counter(a.EP_DISPATCH_BYTES)
        self.batch_unique = histogram(a.BATCH_UNIQUE_EXPERTS, batch_unique_expert_buckets(info))
        self.batch_size = histogram(a.BATCH_SIZE_METRIC)
        self.batch_ep_ranks = histogram(a.BATCH_EP_RANKS_TOUCHED, ep_rank_buckets(info))
        self.batch_ep_max_rank = histogram(a.BATCH_EP_MAX_RANK_EXPERTS, rank_expert_buckets(info))
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
        self.request_duration.record(duration_s, base)
        self.time_to_first_token.record(result.time_to_first_token, base)
        if result.completion_tokens > 1:
            tpot = (result.seconds - result.time_to_first_token) / (result.completion_tokens - 1)
            self.time_per_output_token.record(max(0.0, tpot), base)
        self.record_steps(result.steps, policy)

    def record_batch_pass(self, record: BatchPassRecord) -> None:
        """Once per pass (otel.batch calls it when the pass is complete), not once per request."""
        self.batch_size.record(record.batch_size)
        for layer_attrs, unique in zip(self._batch_layers, record.unique_experts, strict=False):
            self.batch_unique.record(unique, layer_attrs)
        if record.ep_ranks_touched is not None:  # only with --ep-size
            for layer_attrs, ranks, most in zip(self._batch_layers, record.ep_ranks_touched,
                                                record.ep_max_rank_experts, strict=False):
                self.batch_ep_ranks.record(ranks, layer_attrs)
                self.batch_ep_max_rank.record(most, layer_attrs)

    def record_failure(self, duration_s: float, error_type: str) -> None:
        self.request_duration.record(duration_s, {**self.gen_ai_attributes, a.ERROR_TYPE: error_type})

    def record_steps(self, steps: Iterable[StepRecord], policy: DraftPolicy) -> None:
        attrs = {a.SPEC_POLICY_ID: policy.policy_id, a.SPEC_DRAFTER: policy.drafter.value,
                 a.SPEC_DRAFT_LENGTH: policy.draft_length}
        # One attribute dict per layer, built once per request rather than once per step.
        per_layer: list[dict] = []
        cell_attrs: dict[str, dict] = {"": attrs}  # a table's steps name their cell on the drafted histogram
        drafted = committed = dispatched = 0
        predicted, predicted_accepted, predicted_drafted = 0.0, 0, 0  # over the steps the rule predicted
        ep = False
        for step in steps:
            self.step_accepted.record(step.accepted, attrs)
            if step.cell not in cell_attrs:
                cell_attrs[step.cell] = {**attrs, a.SPEC_CELL: step.cell}
            self.step_drafted.record(step.drafted, cell_attrs[step.cell])
            if step.predicted_accepted is not None and step.drafted:
                predicted += step.predicted_accepted
                predicted_accepted += step.accepted
                predicted_drafted += step.drafted
            self.step_cost.record(step.decode_step_equivalents, attrs)
            self.step_seconds.record(step.seconds, attrs)
            while len(per_layer) < len(step.unique_experts):
                per_layer.append({**attrs, a.MOE_LAYER: len(per_layer)})
            for layer_attrs, unique in zip(per_layer, step.unique_experts, strict=False):
                self.step_unique.record(unique, layer_attrs)
            drafted += step.drafted
            committed += step.committed
            if step.ep_ranks_touched is not None:  # only with --ep-size
                ep = True
                dispatched += step.ep_dispatch_bytes
                for layer_attrs, ranks in zip(per_layer, step.ep_ranks_touched, strict=False):
                    self.step_ep_ranks.record(ranks, layer_attrs)
        # Added even when 0 so every policy has both series (acceptance = accepted / drafted).
        self.drafted.add(drafted, attrs)
        self.committed.add(committed, attrs)
        if predicted_drafted:
            # A histogram takes non-negative values only: the size of the error, its sign in the spans' counts.
            self.rule_calibration.record(abs(predicted - predicted_accepted) / predicted_drafted, attrs)
        if ep:
            self.ep_dispatch_bytes.add(dispatched, attrs)
