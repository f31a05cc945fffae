"""Wire a Tuner from explicit settings: storage + server admin + span collector -> Tuner.

One place builds the object graph so the CLI, the demo, the benchmark and the tests assemble the
same thing; every knob arrives in `TuneSettings` (nothing read from the environment here).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import optuna

from service.types import ModelInfo
from tuner.loop.events import TunerEvent
from tuner.loop.fleet import Fleet
from tuner.loop.pruning import PruneRule
from tuner.loop.sampler import InitialDesign, SamplerKind, initial_policies, make_sampler, rationale, temperature_step
from tuner.loop.space import LengthOnly, SearchSpace
from tuner.loop.study import open_study
from tuner.loop.tuner_config import TunerConfig
from tuner.loop.tuning import Tuner
from tuner.measurement.admin import PolicyAdmin
from tuner.measurement.collector import SpanCollector
from tuner.measurement.measure import MeasureConfig, Measurer, TrialMode
from tuner.measurement.window import CostModel, Objective, WindowSpec


@dataclass(frozen=True)
class TuneSettings:
    study_name: str
    trials: int
    tuner_id: str
    objective: Objective = Objective.MEASURED
    sampler: SamplerKind = SamplerKind.TPE
    seed: int | None = None
    window: WindowSpec = field(default_factory=WindowSpec)
    prune: PruneRule = field(default_factory=PruneRule)
    remeasure_top: int = 3
    max_consecutive_failures: int = 3
    stale_seconds: float = 120.0
    poll_seconds: float = 0.25
    policy_check_seconds: float = 1.0
    fixed_bytes_per_pass: int | None = None  # None: estimate from ModelInfo (see cost_model)
    ep_size: int = 0  # the server's --ep-size: its dispatch bytes enter the modelled cost
    # The CLI, demo and benches ask for CORNERS; library callers (the fast tests) keep the original three.
    initial_design: InitialDesign = InitialDesign.BASELINES
    trial_mode: TrialMode | None = None  # None: resolved from the objective and ModelInfo (trial_mode())
    candidate_share: float = 0.5
    switch_window_factor: float = 10.0
    max_consecutive_duplicates: int = 20
    whatif_recording: Path | None = None  # the server's --record-steps file (same machine): the what-if hint
    restrict: LengthOnly | None = None  # search only one drafter's draft length (the what-if bench)
    adaptive: bool = False  # the space holds the moespec rule and its cost weight beside static policies
    by_kind: bool = False  # the space holds tables: one part for greedy requests, one for sampled


def trial_mode(settings: TuneSettings, info: ModelInfo) -> TrialMode:
    """Paired where the backend serves several policies at once in passes of their own,
    control/candidate/control windows where it cannot or where requests share passes (continuous
    batching: a plain control in a pass beside an n-gram k=8 candidate pays for its 9-position
    window, so a paired ratio there favours long drafts; docs/tuner.md). The modelled objective counts
    bytes, which a slower machine does not change, so it needs no control and runs sequentially."""
    if settings.trial_mode is not None:
        if settings.trial_mode is TrialMode.PAIRED and not info.concurrent_policies:
            return TrialMode.INTERLEAVED  # asked for, impossible here: the nearest thing that works
        return settings.trial_mode
    if settings.objective is Objective.MODELLED:
        return TrialMode.SEQUENTIAL
    return TrialMode.PAIRED if info.concurrent_policies and not info.shared_passes else TrialMode.INTERLEAVED


def cost_model(info: ModelInfo, fixed_bytes_per_pass: int | None, ep_size: int = 0) -> CostModel:
    """ModelInfo has no dense-weight size, so by default the fixed part per pass is the shared
    experts counted at one routed expert's size each: a lower bound (the shipped model's shared
    expert is 4x wider, and attention and the LM head come on top). Pass the real figure to be exact."""
    fixed = fixed_bytes_per_pass
    if fixed is None:
        fixed = info.num_layers * info.shared_experts * info.expert_bytes
    # Under EP every dispatched byte also comes back in the combine: it counts twice.
    return CostModel(expert_bytes=info.expert_bytes, fixed_bytes_per_pass=fixed, ep_byte_weight=2.0 if ep_size else 0.0)


@dataclass(frozen=True)
class Assembled:
    tuner: Tuner
    study: optuna.Study
    space: SearchSpace
    info: ModelInfo
    cost: CostModel
    mode: TrialMode


def assemble(
    settings: TuneSettings,
    storage: optuna.storages.BaseStorage,
    admin: PolicyAdmin,
    collector: SpanCollector,
    on_event: Callable[[TunerEvent], None] = lambda e: None,
    fleet: Fleet | None = None,
) -> Assembled:
    info = admin.model_info()
    space = SearchSpace.from_model_info(info, temperature_step=temperature_step(settings.sampler),
                                        adaptive=settings.adaptive, by_kind=settings.by_kind)
    if settings.restrict is not None:
        space = settings.restrict.restrict(space)
    sampler = make_sampler(settings.sampler, settings.seed, settings.trials)
    study = open_study(storage, settings.study_name, sampler, settings.objective.value)
    cost = cost_model(info, settings.fixed_bytes_per_pass, settings.ep_size)
    mode = trial_mode(settings, info)
    if "model_info" not in study.user_attrs:
        # For the report and the dashboard: what the space and the modelled cost were derived from.
        study.set_user_attr("model_info", _info_dict(info))
        study.set_user_attr("sampler", settings.sampler.value)
        study.set_user_attr("sampler_why", rationale(settings.sampler))
        study.set_user_attr("window", asdict(settings.window))
        study.set_user_attr("ep_size", settings.ep_size)
    study.set_user_attr("trial_mode", mode.value)
    study.set_user_attr("candidate_share", settings.candidate_share)
    measurer = Measurer(
        admin,
        collector,
        MeasureConfig(
            window=settings.window,
            prune=settings.prune,
            objective=settings.objective,
            cost=cost,
            poll_seconds=settings.poll_seconds,
            policy_check_seconds=settings.policy_check_seconds,
        ),
    )
    tuner = Tuner(
        study,
        storage,
        space,
        admin,
        measurer,
        TunerConfig(
            study_name=settings.study_name,
            trials=settings.trials,
            tuner_id=settings.tuner_id,
            remeasure_top=settings.remeasure_top,
            stale_seconds=settings.stale_seconds,
            max_consecutive_failures=settings.max_consecutive_failures,
            initial_policies=tuple(initial_policies(settings.sampler, space, settings.initial_design)),
            mode=mode,
            candidate_share=settings.candidate_share,
            switch_window_factor=settings.switch_window_factor,
            max_consecutive_duplicates=settings.max_consecutive_duplicates,
            whatif_recording=settings.whatif_recording,
        ),
        user_attrs=lambda stats: stats.user_attrs(cost, info.decode_step_seconds),
        traffic=collector.traffic,
        on_event=on_event,
        fleet=fleet,
    )
    return Assembled(tuner, study, space, info, cost, mode)


def _info_dict(info: ModelInfo) -> dict[str, object]:
    d = asdict(info)
    d["drafters"] = [x.value for x in info.drafters]
    d["tunable"] = list(info.tunable)
    return d
