"""Which Optuna sampler the tuner uses, and why.

Default: TPE with `multivariate=True, group=True`.
- The space is mixed (integer length, categorical drafter, continuous temperature) and conditional
  (temperature exists only for the model drafter, nothing but the length for plain decoding). TPE
  handles all three kinds; `group=True` splits the history into the sub-spaces that actually
  co-occur, so the temperature model is fit only on model-drafter trials instead of being diluted
  by plain and n-gram ones, and `multivariate=True` models length x temperature jointly (the best
  temperature depends on the length: longer drafts need more agreement per position).
- The objective is a noisy online measurement with a budget of ~30 trials. TPE needs no smooth
  kernel or noise model (GPSampler does, and falls back to independent sampling on dynamic spaces),
  copes with categorical parameters (CMA-ES does not), and `constant_liar=True` keeps several
  tuners on one shared study from asking the same point at once.
- The first trials are an enqueued initial design, so an incumbent exists early for the pruning rule
  and TPE's model starts from points that span the space. `corners` (the CLI's default): plain, each
  drafter at the longest and a short length, the model drafter at T=0. Why: with a budget of 8-10
  trials, three baselines plus TPE's random startup points never reached the grid's best (the
  model drafter, T=0, longest draft) in 5 of 5 noise-benchmark seeds; the corners measure it in the
  first five trials. `baselines` (plain, the default policy, a short n-gram) is the original design.
Alternatives, by flag: `grid` = every point of the discretised space (temperature step 0.5: ~41
points) enqueued up front with `enqueue_trial` and asked in order (RandomSampler only beyond the
grid). It is the benchmark's ground truth but exceeds a 30-trial budget. Not GridSampler (it
would pair every temperature with plain and n-gram trials, which have none) nor BruteForceSampler
(it calls study.stop() when the grid is exhausted, which raises under ask-and-tell); enqueued
trials also survive a restart as WAITING trials. `random` = RandomSampler, a sanity baseline.
"""

from __future__ import annotations

import enum
import warnings

import optuna

from service.types import DraftPolicy
from tuner.loop.space import SearchSpace


class SamplerKind(enum.StrEnum):
    TPE = "tpe"
    GRID = "grid"
    RANDOM = "random"


GRID_TEMPERATURE_STEP = 0.5


def make_sampler(kind: SamplerKind, seed: int | None, n_trials: int) -> optuna.samplers.BaseSampler:
    if kind is not SamplerKind.TPE:
        return optuna.samplers.RandomSampler(seed=seed)  # grid: only used past the enqueued grid
    # A third of the budget for startup (baselines count towards it), at least 4, at most 10.
    startup = max(4, min(10, n_trials // 3))
    with warnings.catch_warnings():
        # multivariate/group are marked experimental; they are the point of choosing TPE here.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=seed, multivariate=True, group=True, constant_liar=True, n_startup_trials=startup
        )


def rationale(kind: SamplerKind) -> str:
    """One line for the logs and the report: which sampler, and why."""
    if kind is SamplerKind.TPE:
        return ("TPE (multivariate, group): mixed, conditional space (temperature only for the model drafter), "
                "noisy online measurements, ~30 trials; baselines first, then TPE")
    if kind is SamplerKind.GRID:
        return "exhaustive grid (temperature step 0.5), enqueued up front: ground truth, not a 30-trial budget"
    return "random: a sanity baseline for the sampler comparison"


def temperature_step(kind: SamplerKind) -> float | None:
    """The grid searches a discrete temperature; the others a continuous one."""
    return GRID_TEMPERATURE_STEP if kind is SamplerKind.GRID else None


def grid_temperatures(max_temperature: float) -> tuple[float, ...]:
    return tuple(i * GRID_TEMPERATURE_STEP for i in range(int(max_temperature / GRID_TEMPERATURE_STEP + 1e-9) + 1))


class InitialDesign(enum.StrEnum):
    """What a fresh TPE study measures before TPE proposes anything."""

    CORNERS = "corners"  # plain, each drafter long and short, the model drafter at T=0 (SearchSpace.corners)
    BASELINES = "baselines"  # plain, the default policy, a short n-gram (the original three)
    NONE = "none"


def initial_policies(kind: SamplerKind, space: SearchSpace, design: InitialDesign) -> list[DraftPolicy]:
    """What a fresh study enqueues: the whole grid, or the initial design."""
    if kind is SamplerKind.GRID:
        return list(space.grid(grid_temperatures(space.max_temperature)))
    if design is InitialDesign.CORNERS:
        return space.corners()
    return space.baselines() if design is InitialDesign.BASELINES else []
