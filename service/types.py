"""Plain dataclasses shared by the engine, the gRPC servicer, telemetry and the tuner.

Validation lives here so every entry point (CLI, gRPC, library) refuses bad input with the same
message; `InvalidRequest.field` names the offending field for gRPC's INVALID_ARGUMENT.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

MAX_DRAFT_LENGTH = 8
MAX_DRAFT_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 64
MAX_POLICY_ID_LENGTH = 128
MAX_COST_WEIGHT = 100.0
MAX_POLICY_CELLS = 16
MAX_TREE_WIDTH = 4  # DraftPolicy.tree_width: a tree's candidates per expanded node


class InvalidRequest(ValueError):
    """Bad input; `field` is the request field at fault (dotted, as in the proto)."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"{field_name}: {problem}")
        self.field = field_name


class Drafter(enum.StrEnum):
    MODEL = "model"  # the shipped (or configured) draft model
    NGRAM = "ngram"  # prompt lookup: copy what followed the latest match of the recent suffix


class Controller(enum.StrEnum):
    """Who decides how many drafts a step proposes (service/engine/spec/adaptive/)."""

    STATIC = "static"  # every step drafts draft_length
    MOESPEC = "moespec"  # per step: expected gain of one more draft against its union-aware marginal cost
    SGLANG = "sglang-ema"  # SGLang's --speculative-adaptive: EMA of accepted length, tiers by batch size
    TRANSFORMERS = "transformers-heuristic"  # +2 after a fully accepted window, -1 otherwise; confidence stop
    CASCADE = "cascade"  # per request: test phases measure utility, speculation off when it is below 1


class RequestKind(enum.StrEnum):
    """Which requests a policy cell applies to (PolicyCell.kind)."""

    ANY = "any"
    GREEDY = "greedy"  # temperature 0
    SAMPLED = "sampled"  # temperature > 0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def validate(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest("sampling.temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequest("sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest("sampling.top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequest("sampling.seed", f"must be in [0, 2^63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class DraftPolicy:
    """How to speculate. draft_length 0 = plain decoding (always valid, often best on MoE).

    With an adaptive controller, draft_length is the most a step may draft: the controller chooses
    each step's length in [0, draft_length] (service/engine/spec/adaptive/).

    With cells, the policy is a table keyed by the step's context: a step runs the policy of the
    cell that matches its pass's occupancy and its request's kind, and the fields above where no
    cell matches. Cells never overlap, so at most one matches (`for_step`).

    With tree_width w > 1 a step drafts a tree rather than a chain (w candidates per expanded node: at
    draft temperature 0 the draft's w most likely tokens, the tree the likeliest nodes; above 0, w
    distinct draws at the root, without replacement) and verifies it in one target pass; draft_length is then the tree's
    node budget, the drafts verified per step, as for a chain.
    Only the model drafter proposes trees (the n-gram drafter proposes chains), and only the static
    controller plans them (the adaptive controllers plan chain lengths).
    """

    drafter: Drafter = Drafter.MODEL
    draft_length: int = 0
    draft_temperature: float = 1.0  # model drafter only; 0 = argmax
    policy_id: str = "default"
    controller: Controller = Controller.STATIC
    cost_weight: float = 1.0  # the moespec controller only: > 1 drafts less, < 1 more
    cells: tuple[PolicyCell, ...] = ()
    tree_width: int = 1  # 1 = a chain; > 1: a tree of draft_length nodes (model drafter, static controller)

    def for_step(self, batch_size: int, greedy: bool) -> tuple[int, DraftPolicy]:
        """(index of the matching cell or -1, the policy a step in that context runs)."""
        for i, cell in enumerate(self.cells):
            if cell.matches(batch_size, greedy):
                return i, cell.policy
        return -1, self

    @property
    def longest_draft(self) -> int:
        """The most drafts any step under this policy may propose (over the table's cells too)."""
        return max([self.draft_length, *(c.policy.draft_length for c in self.cells)])

    def parts(self, field_name: str = "policy") -> list[tuple[str, DraftPolicy]]:
        """(field name, policy) of the base and of each cell: what a backend checks it can run."""
        return [(field_name, self), *((f"{field_name}.cells[{i}].policy", c.policy) for i, c in enumerate(self.cells))]

    @property
    def drafters(self) -> frozenset[Drafter]:
        """The drafters some step under this policy drafts with (none for plain decoding)."""
        return frozenset(p.drafter for _, p in self.parts() if p.draft_length > 0)

    def validate(self, max_draft_length: int = MAX_DRAFT_LENGTH, field_name: str = "policy") -> None:
        if not isinstance(self.drafter, Drafter):
            raise InvalidRequest(f"{field_name}.drafter", f"unknown drafter {self.drafter!r}")
        if not 0 <= self.draft_length <= max_draft_length:
            raise InvalidRequest(f"{field_name}.draft_length",
                                 f"must be in [0, {max_draft_length}], got {self.draft_length}")
        t = self.draft_temperature
        if not math.isfinite(t) or not 0 <= t <= MAX_DRAFT_TEMPERATURE:
            raise InvalidRequest(f"{field_name}.draft_temperature",
                                 f"must be in [0, {MAX_DRAFT_TEMPERATURE}], got {t}")
        if len(self.policy_id) > MAX_POLICY_ID_LENGTH:
            raise InvalidRequest(f"{field_name}.policy_id", f"longer than {MAX_POLICY_ID_LENGTH} characters")
        if not isinstance(self.controller, Controller):
            raise InvalidRequest(f"{field_name}.controller", f"unknown controller {self.controller!r}")
        w = self.cost_weight
        if not math.isfinite(w) or not 0 < w <= MAX_COST_WEIGHT:
            raise InvalidRequest(f"{field_name}.cost_weight", f"must be in (0, {MAX_COST_WEIGHT:g}], got {w}")
        self._validate_tree(field_name)
        self._validate_cells(max_draft_length, field_name)

    def _validate_tree(self, field_name: str) -> None:
        where = f"{field_name}.tree_width"
        if not 1 <= self.tree_width <= MAX_TREE_WIDTH:
            raise InvalidRequest(where, f"must be in [1, {MAX_TREE_WIDTH}] (1 = a chain), got {self.tree_width}")
        if self.tree_width == 1:
            return
        if self.drafter is not Drafter.MODEL:
            raise InvalidRequest(where, f"a tree (tree_width {self.tree_width}) needs the model drafter: the "
                                        f"{self.drafter.value} drafter proposes chains only (give tree_width 1)")
        if self.controller is not Controller.STATIC:
            raise InvalidRequest(where, f"a tree (tree_width {self.tree_width}) needs the static controller: the "
                                        f"{self.controller.value} controller plans chain lengths (give tree_width 1)")

    def _validate_cells(self, max_draft_length: int, field_name: str) -> None:
        if len(self.cells) > MAX_POLICY_CELLS:
            raise InvalidRequest(f"{field_name}.cells", f"at most {MAX_POLICY_CELLS} cells, got {len(self.cells)}")
        for i, cell in enumerate(self.cells):
            where = f"{field_name}.cells[{i}]"
            cell.validate(max_draft_length, where)
            for j, earlier in enumerate(self.cells[:i]):
                if cell.overlaps(earlier):
                    raise InvalidRequest(where, f"{cell.label} overlaps cells[{j}] ({earlier.label}): "
                                                "a step's context must match one cell at most")


@dataclass(frozen=True)
class PolicyCell:
    """One cell of a context-keyed policy: the steps whose pass holds min_batch..max_batch requests
    (max_batch 0: no upper bound) and whose request is of `kind` run `policy` (whose own policy_id
    and cells are unused: responses and spans name the table's id and the cell's `label`)."""

    policy: DraftPolicy
    min_batch: int = 1
    max_batch: int = 0
    kind: RequestKind = RequestKind.ANY

    def matches(self, batch_size: int, greedy: bool) -> bool:
        if batch_size < self.min_batch or (self.max_batch and batch_size > self.max_batch):
            return False
        return self.kind is RequestKind.ANY or (self.kind is RequestKind.GREEDY) == greedy

    def overlaps(self, other: PolicyCell) -> bool:
        kinds = RequestKind.ANY in (self.kind, other.kind) or self.kind is other.kind
        below = self.max_batch and self.max_batch < other.min_batch
        above = other.max_batch and other.max_batch < self.min_batch
        return kinds and not (below or above)

    @property
    def label(self) -> str:
        """The cell's name in spans and metrics: "b1-4.greedy", "b9+.any"."""
        batch = f"{self.min_batch}+" if not self.max_batch else f"{self.min_batch}-{self.max_batch}"
        return f"b{batch}.{self.kind.value}"

    def validate(self, max_draft_length: int, field_name: str) -> None:
        if self.min_batch < 1:
            raise InvalidRequest(f"{field_name}.min_batch", f"must be >= 1, got {self.min_batch}")
        if self.max_batch and self.max_batch < self.min_batch:
            raise InvalidRequest(f"{field_name}.max_batch",
                                 f"must be 0 (no bound) or >= min_batch {self.min_batch}, got {self.max_batch}")
        if not isinstance(self.kind, RequestKind):
            raise InvalidRequest(f"{field_name}.kind", f"unknown request kind {self.kind!r}")
        if self.policy.cells:
            raise InvalidRequest(f"{field_name}.policy.cells", "a cell's policy cannot be a table itself")
        self.policy.validate(max_draft_length, f"{field_name}.policy")


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    max_new_tokens: int = 64
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()

    def validate(self, vocab_size: int, max_context: int) -> None:
        """Checks that need no tokenizer; prompt length is checked once tokenized."""
        if self.prompt and self.prompt_token_ids:
            raise InvalidRequest("prompt", "give prompt or prompt_token_ids, not both")
        if not self.prompt and not self.prompt_token_ids:
            raise InvalidRequest("prompt", "is empty (give prompt or prompt_token_ids)")
        bad = [t for t in self.prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest("prompt_token_ids", f"{bad[0]} is outside the vocabulary [0, {vocab_size})")
        if not 1 <= self.max_new_tokens <= max_context:
            raise InvalidRequest("max_new_tokens", f"must be in [1, {max_context}], got {self.max_new_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_LENGTH:
                raise InvalidRequest("stop", f"each stop string needs 1..{MAX_STOP_LENGTH} characters, got {len(s)}")
        self.sampling.validate()


def new_token_budget(max_new_tokens: int, prompt_tokens: int, max_context: int) -> int:
    """Tokens a request may generate: its max_new_tokens, cut to the context's room after the prompt
    (a long prompt shortens the generation instead of failing it). Every backend applies this, and
    the response reports it (GenerateResponse.max_new_tokens / max_new_tokens_cut)."""
    return min(max_new_tokens, max_context - prompt_tokens)


@dataclass(frozen=True)
class BatchPassRecord:
    """One target pass of continuous batching: the windows of every running request, verified at once.

    The requests' own StepRecords carry their own windows' unions; this is the pass's view: the
    distinct routed experts each layer had to run for all of them together (the batch union).
    """

    pass_id: int  # increasing per engine
    batch_size: int  # requests the pass served
    positions: int  # tokens in the pass: the sum of the windows
    windows: tuple[int, ...]  # [batch_size] each request's window, in pass order
    unique_experts: tuple[int, ...]  # [L] distinct routed experts per MoE layer over the whole pass
    unique_experts_bound: int  # min(E, positions * m)
    draft_seconds: float  # the pass's draft phase (n-gram lookups, batched draft-model passes)
    verify_seconds: float  # the target pass plus every request's acceptance
    start_time_ns: int  # wall clock (time.time_ns()) when the draft phase began
    prefill_tokens: int = 0  # prompt tokens of the prefill pass run just before this one: what its requests waited for
    # The expert-parallel view of the whole pass (only with an EP size; service/routing/expert_parallel.py).
    ep_ranks_touched: tuple[int, ...] | None = None  # [L] ranks running at least one of the pass's pairs
    ep_max_rank_experts: tuple[int, ...] | None = None  # [L] most distinct experts on one rank
    ep_dispatch_bytes: int | None = None  # the pass's pairs sent off their home rank * hidden * dtype bytes

    @property
    def end_time_ns(self) -> int:
        return self.start_time_ns + int((self.draft_seconds + self.verify_seconds) * 1e9)


def accepted_positions(drafted: int, accepted: int) -> tuple[bool, ...]:
    """[drafted] per-position acceptance of one step: draft i counts iff i < accepted.

    Acceptance is a prefix: the first rejected draft ends the step, so a later draft that happens to
    equal the target's token was never accepted (the target's own token replaced the rejected one
    and everything after it was discarded). Every backend and the step-recording loader build the
    per-position vector here, so the backends cannot disagree on it."""
    return tuple(i < accepted for i in range(drafted))


def tree_depths(parents: tuple[int, ...]) -> tuple[int, ...]:
    """[nodes] each draft node's depth (1 = a child of the window's first token) from its parent
    index (-1 = that first token); parents come before their children (StepRecord.tree_parents)."""
    depths: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"tree node {i}: parent {parent} is not an earlier node or -1")
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return tuple(depths)


def tree_branches(parents: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The root-to-leaf branches of a draft tree: for each leaf (a node nobody's parent), in the order
    of the leaves' node indices, the nodes from depth 1 down to that leaf. () for no drafts."""
    tree_depths(parents)  # refuses a malformed tree
    inner = set(parents)
    branches = []
    for leaf in (i for i in range(len(parents)) if i not in inner):
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = parents[node]
        branches.append(tuple(reversed(path)))
    return tuple(branches)


@dataclass(frozen=True)
class StepRecord:
    """One draft/verify step (or one plain decode step: window 1, drafted = accepted = 0).

    A step of a tree policy (tree_width > 1) verified a tree of `drafted` nodes in one pass. Then
    `window` = drafted + 1 (the window's first token, then the nodes in drafting order), `accepted`
    is the length of the accepted path (the branch the target kept), `accepted_per_position[i]` says
    whether node i lies on it (not a prefix: the accepted nodes need not be the first ones),
    `unique_experts` is the union over every position of the tree, and `branch_unique` the union over
    each root-to-leaf branch: what one chain along that branch would have touched.
    """

    drafter: Drafter
    draft_length: int  # the policy's k
    draft_temperature: float
    policy_id: str
    drafted: int  # tokens proposed this step (n-gram may propose fewer than k, or none)
    accepted: int  # drafted tokens the target accepted
    committed: int  # tokens this step added to the output: accepted + the target's own (fewer only if EOS ended it)
    # [drafted] chain: draft i accepted, i.e. i < accepted (accepted_positions); tree: node i lies on the
    # accepted path
    accepted_per_position: tuple[bool, ...]
    window: int  # positions in the verify pass = drafted + 1
    unique_experts: tuple[int, ...]  # [L] distinct routed experts per MoE layer over the window (a tree: every node)
    shared_experts: int  # always-active shared experts per layer
    unique_experts_bound: int  # min(E, window * m)
    draft_seconds: float
    verify_seconds: float
    decode_step_equivalents: float  # verify_seconds / the engine's recent plain decode step time
    # [L, w, m] when captured; positions in window order (a tree: the first token, then the nodes in drafting order)
    topk_ids: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    window_ids: tuple[int, ...] | None = None  # [w] the verified tokens, captured with topk_ids
    # [L] mean and smallest |S_i ∩ S_j| over the window's position pairs (service/routing/expert_sets.py);
    # () where the routing was not counted.
    pairwise_overlap_mean: tuple[float, ...] = ()
    pairwise_overlap_min: tuple[int, ...] = ()
    # Expert-parallel estimate of this pass (service.routing.expert_parallel), when an EP size is configured.
    ep_ranks_touched: tuple[int, ...] | None = None  # [L] ranks running at least one routed pair
    ep_max_rank_experts: tuple[int, ...] | None = None  # [L] most distinct experts on one rank
    ep_dispatch_bytes: int | None = None  # token-expert pairs sent off the home rank * hidden * dtype bytes
    batch: BatchPassRecord | None = None  # the pass this step's window was verified in (batching engines)
    controller: Controller = Controller.STATIC
    planned: int | None = None  # drafts the controller asked of the drafter (None: the policy's draft_length)
    predicted_accepted: float | None = None  # the moespec rule's expected accepted drafts of this step
    cell: str = ""  # the label of the table cell whose policy this step ran ("": the base policy)
    tree_width: int = 1  # the policy's (DraftPolicy.tree_width); 1 = a chain
    # Trees only (() for a chain). [drafted] node i's parent node, -1 = the window's first token (the last
    # committed token); nodes in drafting order, parents before children (tree_depths, tree_branches).
    tree_parents: tuple[int, ...] = ()
    # [branches][L] per root-to-leaf branch (one per leaf, in the order of the leaves' node indices): the
    # distinct routed experts per MoE layer over the branch's positions, the window's first token included.
    # () for a chain, whose one branch is the window (unique_experts).
    branch_unique: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of_policy(cls, policy: DraftPolicy, *, drafted: int, accepted: int, committed: int,
                  accepted_per_position: tuple[bool, ...], window: int, unique_experts: tuple[int, ...],
                  shared_experts: int, num_experts: int, top_k: int, draft_seconds: float, verify_seconds: float,
                  decode_step_equivalents: float, **optional) -> StepRecord:
        """The one constructor both backends use: the policy's fields copied, the union's bound
        min(E, window * m) derived; `optional` holds topk_ids, window_ids, the EP fields, batch and,
        for a tree, tree_parents and branch_unique."""
        return cls(drafter=policy.drafter, draft_length=policy.draft_length, controller=policy.controller,
                   tree_width=policy.tree_width,
                   draft_temperature=policy.draft_temperature, policy_id=policy.policy_id, drafted=drafted,
                   accepted=accepted, committed=committed, accepted_per_position=accepted_per_position,
                   window=window, unique_experts=unique_experts, shared_experts=shared_experts,
                   unique_experts_bound=min(num_experts, window * top_k), draft_seconds=draft_seconds,
                   verify_seconds=verify_seconds, decode_step_equivalents=decode_step_equivalents, **optional)

    @property
    def seconds(self) -> float:
        return self.draft_seconds + self.verify_seconds

    @property
    def empty_draft(self) -> bool:
        """Drafts were asked for and the drafter proposed none (n-gram found no match)."""
        return self.drafted == 0 and (self.draft_length if self.planned is None else self.planned) > 0

    @property
    def widest_layer(self) -> int:
        return max(range(len(self.unique_experts)), key=self.unique_experts.__getitem__) if self.unique_experts else -1

    @property
    def is_tree(self) -> bool:
        """The step verified a tree of drafts: it records the tree (a tree policy's step that drafted one
        node verified a chain, and records none)."""
        return bool(self.tree_parents)

    @property
    def tree_depth(self) -> int:
        """The deepest draft's depth: the longest path the step could have accepted (a chain: drafted)."""
        return max(tree_depths(self.tree_parents), default=0) if self.tree_parents else self.drafted

    @property
    def branches(self) -> int:
        """Root-to-leaf branches the step verified (a chain: 1)."""
        return len(self.branch_unique) or 1

    @property
    def branch_unique_mean(self) -> tuple[float, ...]:
        """[L] the mean over the branches of each branch's union (a chain: its window's union)."""
        if not self.branch_unique:
            return tuple(float(u) for u in self.unique_experts)
        return tuple(sum(layer) / len(layer) for layer in zip(*self.branch_unique, strict=True))

    @property
    def branch_unique_max(self) -> tuple[int, ...]:
        """[L] the widest branch's union per layer (a chain: its window's union)."""
        if not self.branch_unique:
            return self.unique_experts
        return tuple(max(layer) for layer in zip(*self.branch_unique, strict=True))

    @property
    def accepted_per_depth(self) -> tuple[bool, ...]:
        """Per draft depth (0 = the first draft of the window's accepted path): accepted. A chain's
        positions are its depths, so this is accepted_per_position; a tree's accepted path is a prefix
        of its depths, so depth i counts iff i < accepted."""
        return accepted_positions(self.tree_depth, self.accepted) if self.tree_parents else self.accepted_per_position


@dataclass(frozen=True)
class SpecStats:
    """Exact per-request aggregates of the step records (what the response and request span carry)."""

    verify_steps: int
    drafted_tokens: int
    accepted_tokens: int
    committed_tokens: int
    accepted_per_position: tuple[int, ...]  # [k] how often draft position (a tree: depth) i was accepted
    unique_experts_mean: tuple[float, ...]  # [L]
    unique_experts_max: tuple[int, ...]  # [L]
    draft_seconds: float
    verify_seconds: float
    empty_drafts: int  # steps where the drafter proposed nothing (n-gram found no match)
    policy_id: str
    drafter: Drafter
    draft_length: int
    draft_temperature: float
    # [L] mean over the steps of the batch union of the pass each was verified in; () when no step
    # came from a batched pass (a backend that does not report passes)
    batch_unique_experts_mean: tuple[float, ...] = ()
    controller: Controller = Controller.STATIC
    tree_width: int = 1  # the policy's (1 = chains)
    # [L] mean over the steps of each step's mean branch union (StepRecord.branch_unique_mean; a chain
    # step's one branch is its window); () when no step drafted a tree (it would equal unique_experts_mean)
    branch_unique_experts_mean: tuple[float, ...] = ()

    @property
    def seconds_per_committed_token(self) -> float:
        return (self.draft_seconds + self.verify_seconds) / max(1, self.committed_tokens)

    @classmethod
    def from_steps(cls, steps: list[StepRecord], policy: DraftPolicy, num_layers: int) -> SpecStats:
        per_position = [0] * policy.longest_draft
        for s in steps:
            # by depth: a tree's node indices are not positions along the path it accepted
            for i, ok in enumerate(s.accepted_per_depth):
                per_position[i] += int(ok)
        n = len(steps)
        layers = range(num_layers)
        batched = [s.batch for s in steps if s.batch is not None]
        trees = [s for s in steps if s.is_tree]
        branch_means = [s.branch_unique_mean for s in steps] if trees else []
        return cls(
            verify_steps=n,
            drafted_tokens=sum(s.drafted for s in steps),
            accepted_tokens=sum(s.accepted for s in steps),
            committed_tokens=sum(s.committed for s in steps),
            accepted_per_position=tuple(per_position),
            unique_experts_mean=tuple(sum(s.unique_experts[i] for s in steps) / n if n else 0.0 for i in layers),
            unique_experts_max=tuple(max((s.unique_experts[i] for s in steps), default=0) for i in layers),
            draft_seconds=sum(s.draft_seconds for s in steps),
            verify_seconds=sum(s.verify_seconds for s in steps),
            empty_drafts=sum(1 for s in steps if s.empty_draft),
            policy_id=policy.policy_id,
            drafter=policy.drafter,
            draft_length=policy.draft_length,
            draft_temperature=policy.draft_temperature,
            batch_unique_experts_mean=tuple(sum(b.unique_experts[i] for b in batched) / len(batched)
                                            for i in layers) if batched else (),
            controller=policy.controller,
            tree_width=policy.tree_width,
            branch_unique_experts_mean=tuple(sum(b[i] for b in branch_means) / n for i in layers) if trees else (),
        )


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_new_tokens or the context limit
    CANCELLED = "cancelled"  # the caller asked to stop (client gone, deadline)


@dataclass(frozen=True)
class GenerationResult:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    spec: SpecStats
    steps: tuple[StepRecord, ...]
    seconds: float  # wall time of the whole request, prefill included
    time_to_first_token: float


@dataclass(frozen=True)
class StreamDelta:
    """Tokens committed by one step, as they become final (text held back until it is valid UTF-8)."""

    text: str
    token_ids: tuple[int, ...]
    step: StepRecord  # the step that committed them


@dataclass(frozen=True)
class ModelInfo:
    backend: str
    model_name: str
    draft_model_name: str
    num_layers: int  # MoE layers reported in unique_experts arrays
    num_experts: int
    top_k: int
    shared_experts: int
    vocab_size: int
    max_context: int
    max_draft_length: int
    drafters: tuple[Drafter, ...]
    # knobs the tuner may search: "drafter", "draft_length", "draft_temperature", "tree_width"
    tunable: tuple[str, ...]
    expert_bytes: int  # bytes of one routed expert's weights (the modelled cost's unit)
    decode_step_seconds: float  # the engine's calibrated plain decode step
    # What changing the policy costs: 0 for the embedded engine (any policy, any request); SGLang
    # fixes speculation at start-up, so a change swaps engines (the last swap's wall time).
    policy_switch_seconds: float = 0.0
    policy_switches: int = 0
    # Draft lengths a change among which swaps no engine (SGLang's adaptive EAGLE states, pinned at run
    # time), and the last such change's wall time / how many so far. () = every change swaps (or none does).
    prepared_draft_lengths: tuple[int, ...] = ()
    length_switch_seconds: float = 0.0
    length_switches: int = 0
    # Whether requests under different policies can run at once (a traffic split of several arms).
    # False unless a backend says so: a backend that fixes its policy at start-up cannot.
    concurrent_policies: bool = False
    device: str = ""  # where the backend computes ("cpu", "cuda"); "" = not reported
    # Requests in flight together share target passes (continuous batching): each is charged its
    # whole pass, so policies served at once pay for each other's windows.
    shared_passes: bool = False
    # This server process's identity among replicas (its `service.instance.id` resource attribute);
    # "" where the backend alone reports (the server fills it in) or an older server answers.
    instance_id: str = ""
    # The draft-length controllers a policy may name (STATIC everywhere) and, where some are not
    # offered, why.
    controllers: tuple[Controller, ...] = (Controller.STATIC,)
    controllers_note: str = ""
    # Whether a policy may be a table of cells keyed by the step's context (DraftPolicy.cells).
    policy_tables: bool = False
    # The widest draft tree a policy may ask for (DraftPolicy.tree_width); 1 = chains only.
    max_tree_width: int = 1
