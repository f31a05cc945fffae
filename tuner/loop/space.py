"""The draft-policy search space, derived from the server's ModelInfo (never hard-coded).

Contract: the space is conditional, asked in this order so that equivalent policies are one point:
  draft_length in 0..max_draft_length            (0 = plain decoding: nothing else is asked)
  drafter in ModelInfo.drafters                  (only when draft_length > 0 and "drafter" is tunable)
  draft_greedy in {true, false}                  (only for the model drafter, when the temperature is
                                                  tunable and continuous: true = argmax drafts, T = 0)
  draft_temperature in [0, max_temperature]      (only for the model drafter, when tunable and not greedy)
  tree_width in 1..max_tree_width                (only for the model drafter at draft_length >= 2 (one node
                                                  is a chain), when "tree_width" is tunable and the server
                                                  drafts trees: ModelInfo.max_tree_width > 1; draft_length
                                                  is then the tree's node budget; the grid keeps widths up
                                                  to the budget, as a wider tree runs as one that wide)
  controller in {static, moespec}                (only with `tune_controller`, when the server offers
                                                  moespec, and only for a chain (a tree runs the static
                                                  controller): draft_length is then the rule's most)
  cost_weight in [0.25, 4], log scale            (only for moespec; GRID_COST_WEIGHTS on the grid)
With `table_by_kind` the policy is a table of two parts, each asked in the order above under its
own prefix ("greedy." and "sampled."): greedy requests run the first (a cell), sampled ones the
second (the table's base), so the tuner can pick argmax drafts for greedy requests and plain for
sampled ones in one policy. Static policies stay in the space as the special case.
Knobs missing from ModelInfo.tunable keep the server's defaults. `temperature_step` makes the space
discrete (for the exhaustive grid, where T = 0 is a grid point and draft_greedy is not asked);
without it the temperature is continuous, and greedy drafting is a point of its own: a continuous
range puts no mass on T = 0 exactly, where argmax drafts (the most agreement per position for a
greedy request) are often the best policy, and a search would otherwise settle on a small T > 0
that drafts worse. Trials stored without draft_greedy (older studies) read as sampled. `LengthOnly` narrows a
space to the draft length of one drafter at a fixed draft temperature (the question the what-if hint
answers; `moespec bench tuner --scenario whatif`), passed down explicitly (TuneSettings.restrict).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import optuna

from service.policy.ids import canonical, is_plain, temperature_matters
from service.types import MAX_DRAFT_TEMPERATURE, Controller, Drafter, DraftPolicy, ModelInfo, PolicyCell, RequestKind

DEFAULT_TEMPERATURE = DraftPolicy().draft_temperature
# The range; the service accepts more, but beyond ~1.5 a small draft is close to uniform.
SEARCH_MAX_TEMPERATURE = 1.5
COST_WEIGHT_RANGE = (0.25, 4.0)  # the moespec rule's weight: 4x cheaper to 4x dearer than measured
GRID_COST_WEIGHTS = (0.5, 1.0, 2.0)
KIND_PREFIXES = ("greedy.", "sampled.")  # the two parts of a table by request kind


@dataclass(frozen=True)
class PolicyKey:
    """What makes two policies the same measurement (the policy id deliberately excluded)."""

    drafter: str  # "plain" for draft_length 0, else the drafter's value
    draft_length: int
    draft_temperature: float | None  # None where it has no effect
    controller: str = "static"  # who picks each step's length (draft_length its most)
    cost_weight: float | None = None  # the moespec controller's only
    cells: tuple[tuple[str, PolicyKey], ...] = ()  # a table's cells: (label, key)
    tree_width: int = 1  # 1 = a chain

    def label(self) -> str:
        if self.cells:
            parts = [f"{label}: {key.label()}" for label, key in self.cells]
            return f"{self._single_label()} | " + " | ".join(parts)
        return self._single_label()

    def _single_label(self) -> str:
        if self.drafter == "plain":
            return "plain"
        label = f"{self.drafter} k={self.draft_length}"
        if self.draft_temperature is not None:
            label += f" T={self.draft_temperature:.2f}"
        if self.tree_width > 1:
            label += f" tw={self.tree_width}"
        if self.controller != "static":
            label = f"{self.controller} {label}" + (f" w={self.cost_weight:g}" if self.cost_weight is not None else "")
        return label


def policy_key(policy: DraftPolicy) -> PolicyKey:
    """Grouped by the rules the server derives policy ids with (service.policy.ids): the fields a
    policy's drafter ignores do not tell policies apart."""
    if policy.cells:
        cells = tuple((c.label, policy_key(c.policy)) for c in policy.cells)
        return replace(policy_key(replace(policy, cells=())), cells=cells)
    if is_plain(policy):
        return PolicyKey("plain", 0, None)
    # Rounded so that a re-measured continuous temperature groups with its original trial.
    temperature = round(policy.draft_temperature, 4) if temperature_matters(policy) else None
    c = canonical(policy)
    weight = round(c.cost_weight, 4) if c.controller is Controller.MOESPEC else None
    return PolicyKey(policy.drafter.value, policy.draft_length, temperature, c.controller.value, weight,
                     tree_width=c.tree_width)


@dataclass(frozen=True)
class SearchSpace:
    max_draft_length: int
    drafters: tuple[Drafter, ...]
    tune_drafter: bool
    tune_length: bool
    tune_temperature: bool
    max_temperature: float = SEARCH_MAX_TEMPERATURE
    temperature_step: float | None = None
    fixed_temperature: float = DEFAULT_TEMPERATURE  # the model drafter's temperature when it is not tuned
    tune_controller: bool = False  # static or the moespec rule (with its cost weight)
    table_by_kind: bool = False  # one part for greedy requests, one for sampled ones
    max_tree_width: int = 1  # > 1: the model drafter's policies may be trees up to this width

    @classmethod
    def from_model_info(
        cls, info: ModelInfo, max_temperature: float = SEARCH_MAX_TEMPERATURE, temperature_step: float | None = None,
        adaptive: bool = False, by_kind: bool = False,
    ) -> SearchSpace:
        """adaptive / by_kind: search the moespec rule, and tables by request kind; ValueError where
        the server offers neither."""
        if adaptive and Controller.MOESPEC not in info.controllers:
            raise ValueError("the server does not offer the moespec controller"
                             + (f" ({info.controllers_note})" if info.controllers_note else ""))
        if by_kind and not info.policy_tables:
            raise ValueError("the server takes no table policies (ModelInfo.policy_tables is false)")
        return cls(
            tune_controller=adaptive,
            table_by_kind=by_kind,
            max_draft_length=info.max_draft_length,
            drafters=tuple(info.drafters) or (Drafter.MODEL,),
            tune_drafter="drafter" in info.tunable and len(info.drafters) > 1,
            tune_length="draft_length" in info.tunable,
            tune_temperature="draft_temperature" in info.tunable,
            max_temperature=min(max_temperature, MAX_DRAFT_TEMPERATURE),
            temperature_step=temperature_step,
            max_tree_width=info.max_tree_width if "tree_width" in info.tunable else 1,
        )

    @property
    def tree_widths(self) -> list[int]:
        """The widths a model-drafter policy may have (1 = a chain): [1] where trees are not searched."""
        return list(range(1, self.max_tree_width + 1))

    def suggest(self, trial: optuna.Trial, policy_id: str) -> DraftPolicy:
        """Ask the trial for a policy, following the conditional order above."""
        if self.table_by_kind:
            greedy, sampled = (self._suggest_part(trial, prefix) for prefix in KIND_PREFIXES)
            return by_kind(greedy, sampled, policy_id)
        return replace(self._suggest_part(trial, ""), policy_id=policy_id)

    def _suggest_part(self, trial: optuna.Trial, prefix: str) -> DraftPolicy:
        length = trial.suggest_int(f"{prefix}draft_length", 0, self.max_draft_length) if self.tune_length else 0
        if length == 0:
            return DraftPolicy(draft_length=0, policy_id="")
        drafter = self.drafters[0]
        if self.tune_drafter:
            drafter = Drafter(trial.suggest_categorical(f"{prefix}drafter", [d.value for d in self.drafters]))
        temperature = self.fixed_temperature if drafter is Drafter.MODEL else DEFAULT_TEMPERATURE
        if drafter is Drafter.MODEL and self.tune_temperature:
            if self.temperature_step is None and trial.suggest_categorical(f"{prefix}draft_greedy", [True, False]):
                temperature = 0.0
            else:
                temperature = trial.suggest_float(
                    f"{prefix}draft_temperature", 0.0, self.max_temperature, step=self.temperature_step
                )
        width = 1
        if drafter is Drafter.MODEL and self.max_tree_width > 1 and length > 1:  # (one node is a chain)
            width = trial.suggest_categorical(f"{prefix}tree_width", self.tree_widths)
        controller, weight = Controller.STATIC, DraftPolicy().cost_weight
        if self.tune_controller and width == 1:  # the adaptive controllers plan chains
            controller = Controller(trial.suggest_categorical(
                f"{prefix}controller", [Controller.STATIC.value, Controller.MOESPEC.value]))
            if controller is Controller.MOESPEC:
                weight = trial.suggest_float(f"{prefix}cost_weight", *COST_WEIGHT_RANGE, log=True)
        return DraftPolicy(drafter=drafter, draft_length=length, draft_temperature=temperature, policy_id="",
                           controller=controller, cost_weight=weight, tree_width=width)

    def policy_from_params(self, params: dict[str, object], policy_id: str) -> DraftPolicy:
        """Rebuild a stored trial's policy (the inverse of `suggest`)."""
        if self.table_by_kind:
            greedy, sampled = (self._part_from_params(params, prefix) for prefix in KIND_PREFIXES)
            return by_kind(greedy, sampled, policy_id)
        return replace(self._part_from_params(params, ""), policy_id=policy_id)

    def _part_from_params(self, params: dict[str, object], prefix: str) -> DraftPolicy:
        length = int(params.get(f"{prefix}draft_length", 0))
        if length == 0:
            return DraftPolicy(draft_length=0, policy_id="")
        drafter = Drafter(params.get(f"{prefix}drafter", self.drafters[0].value))
        default = self.fixed_temperature if drafter is Drafter.MODEL else DEFAULT_TEMPERATURE
        greedy = params.get(f"{prefix}draft_greedy")
        temperature = 0.0 if greedy else float(params.get(f"{prefix}draft_temperature", default))
        controller = Controller(params.get(f"{prefix}controller", Controller.STATIC.value))
        weight = float(params.get(f"{prefix}cost_weight", DraftPolicy().cost_weight))
        width = int(params.get(f"{prefix}tree_width", 1))  # trials stored before trees were searched: chains
        return DraftPolicy(drafter=drafter, draft_length=length, draft_temperature=temperature, policy_id="",
                           controller=controller, cost_weight=weight, tree_width=width)

    def params_of(self, policy: DraftPolicy) -> dict[str, object]:
        """The Optuna params that make `suggest` return `policy` (for enqueue_trial); a policy
        without cells in a space of tables is the table that runs it for both kinds."""
        if self.table_by_kind:
            greedy, sampled = kind_parts(policy)
            return {**self._params_of_part(greedy, KIND_PREFIXES[0]), **self._params_of_part(sampled, KIND_PREFIXES[1])}
        return self._params_of_part(policy, "")

    def _params_of_part(self, policy: DraftPolicy, prefix: str) -> dict[str, object]:
        params: dict[str, object] = {f"{prefix}draft_length": policy.draft_length}
        if policy.draft_length and self.tune_drafter:
            params[f"{prefix}drafter"] = policy.drafter.value
        if policy.draft_length and policy.drafter is Drafter.MODEL and self.tune_temperature:
            greedy = self.temperature_step is None and policy.draft_temperature == 0
            if self.temperature_step is None:
                params[f"{prefix}draft_greedy"] = greedy
            if not greedy:
                params[f"{prefix}draft_temperature"] = policy.draft_temperature
        if policy.draft_length > 1 and policy.drafter is Drafter.MODEL and self.max_tree_width > 1:
            params[f"{prefix}tree_width"] = policy.tree_width
        if policy.draft_length and self.tune_controller and policy.tree_width == 1:
            params[f"{prefix}controller"] = policy.controller.value
            if policy.controller is Controller.MOESPEC:
                params[f"{prefix}cost_weight"] = policy.cost_weight
        return params

    def contains(self, policy: DraftPolicy) -> bool:
        return all(self._contains_part(part) for _, part in policy.parts()) and (
            not policy.cells or self.table_by_kind)

    def _contains_part(self, policy: DraftPolicy) -> bool:
        lo, hi = COST_WEIGHT_RANGE
        return (
            0 <= policy.draft_length <= self.max_draft_length
            and (policy.draft_length == 0 or policy.drafter in self.drafters)
            and 0.0 <= policy.draft_temperature <= self.max_temperature
            and (policy.draft_length == 0 or policy.controller is Controller.STATIC
                 or (self.tune_controller and policy.controller is Controller.MOESPEC
                     and lo <= policy.cost_weight <= hi))
            and (policy.draft_length == 0 or policy.tree_width == 1
                 or (policy.drafter is Drafter.MODEL and policy.tree_width <= self.max_tree_width))
        )

    def baselines(self) -> list[DraftPolicy]:
        """Policies worth measuring first: plain decoding, the default policy, a short n-gram."""
        out = [DraftPolicy(draft_length=0)]
        if self.tune_length and self.max_draft_length >= 1:
            length = min(3, self.max_draft_length)
            out.append(DraftPolicy(drafter=Drafter.MODEL, draft_length=length, draft_temperature=1.0))
            if Drafter.NGRAM in self.drafters and self.tune_drafter:
                out.append(DraftPolicy(drafter=Drafter.NGRAM, draft_length=length))
        return [p for p in out if p.drafter in self.drafters or p.draft_length == 0]

    def corners(self) -> list[DraftPolicy]:
        """A small deterministic initial design that spans the space before TPE models it: plain
        decoding, then each drafter at the longest and at a short draft length, the model drafter at
        temperature 0 (argmax drafts: the most agreement per position), and where trees are searched
        the widest tree at the longest budget. Long first: on this model pair the long argmax draft is
        the one a few random TPE startup points kept missing."""
        out = [DraftPolicy(draft_length=0)]
        if not self.tune_length or self.max_draft_length < 1:
            return out
        drafters = self.drafters if self.tune_drafter else self.drafters[:1]
        temperature = 0.0 if self.tune_temperature else self.fixed_temperature
        short = min(2, self.max_draft_length)
        for length in dict.fromkeys((self.max_draft_length, short)):
            for drafter in drafters:
                out.append(DraftPolicy(drafter=drafter, draft_length=length,
                                       draft_temperature=temperature if drafter is Drafter.MODEL else
                                       DEFAULT_TEMPERATURE))
        if self.max_tree_width > 1 and Drafter.MODEL in drafters:
            # The widest tree at the longest budget: the corner of the tree axis, which a chain-only
            # initial design leaves to TPE's random start-up to find.
            out.append(DraftPolicy(drafter=Drafter.MODEL, draft_length=self.max_draft_length,
                                   draft_temperature=temperature, tree_width=self.max_tree_width))
        return out

    def grid(self, temperatures: tuple[float, ...]) -> Iterator[DraftPolicy]:
        """Every point of the discrete space (plain once, n-gram per length, model per length x T x tree
        width; each drafting chain also under the moespec rule at GRID_COST_WEIGHTS with `tune_controller`;
        with `table_by_kind`, every pair of those for greedy and sampled requests)."""
        singles = list(self._single_grid(temperatures))
        if self.tune_controller:
            singles += [replace(p, controller=Controller.MOESPEC, cost_weight=w)
                        for p in list(singles) if p.draft_length and p.tree_width == 1 for w in GRID_COST_WEIGHTS]
        if not self.table_by_kind:
            yield from singles
            return
        for greedy in singles:
            for sampled in singles:
                yield by_kind(greedy, sampled, "")

    def _single_grid(self, temperatures: tuple[float, ...]) -> Iterator[DraftPolicy]:
        yield DraftPolicy(draft_length=0)
        if not self.tune_length:
            return
        for length in range(1, self.max_draft_length + 1):
            for drafter in self.drafters if self.tune_drafter else self.drafters[:1]:
                if drafter is not Drafter.MODEL:
                    yield DraftPolicy(drafter=drafter, draft_length=length)
                    continue
                for t in temperatures if self.tune_temperature else (self.fixed_temperature,):
                    for width in (w for w in self.tree_widths if w <= length):  # (a wider tree runs as this one)
                        yield DraftPolicy(drafter=drafter, draft_length=length, draft_temperature=t, tree_width=width)


def by_kind(greedy: DraftPolicy, sampled: DraftPolicy, policy_id: str) -> DraftPolicy:
    """The table that runs `greedy` for greedy requests and `sampled` for the others."""
    cell = PolicyCell(replace(greedy, policy_id=""), kind=RequestKind.GREEDY)
    return replace(sampled, policy_id=policy_id, cells=(cell,))


def kind_parts(policy: DraftPolicy) -> tuple[DraftPolicy, DraftPolicy]:
    """(greedy part, sampled part) of a policy: a `by_kind` table's two, or the policy twice."""
    base = replace(policy, cells=(), policy_id="")
    return (policy.for_step(1, greedy=True)[1] if policy.cells else base), base


@dataclass(frozen=True)
class LengthOnly:
    """Search only the draft length (0 = plain decoding included) of one drafter, at a fixed draft
    temperature (model drafter only), as chains. Why it exists: the what-if hint answers "which draft length for
    this drafter"; in the full space its savings drown in TPE's drafter and temperature choices."""

    drafter: Drafter
    draft_temperature: float = 0.0

    def restrict(self, space: SearchSpace) -> SearchSpace:
        """`space` narrowed; ValueError when the server does not offer the drafter or cannot tune the length."""
        if self.drafter not in space.drafters:
            raise ValueError(f"drafter {self.drafter.value!r} is not offered by the server "
                             f"({', '.join(d.value for d in space.drafters)})")
        if not space.tune_length:
            raise ValueError("the server does not let the draft length be tuned")
        return replace(space, drafters=(self.drafter,), tune_drafter=False, tune_temperature=False,
                       fixed_temperature=self.draft_temperature, max_tree_width=1)

    def label(self) -> str:
        if self.drafter is Drafter.MODEL:
            return f"{self.drafter.value} T={self.draft_temperature:g}"
        return self.drafter.value
