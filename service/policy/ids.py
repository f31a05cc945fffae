"""Canonical draft policies and the ids derived from them: one policy, one id.

A policy carries fields its drafter ignores: with draft_length 0 nothing is drafted, so drafter and
draft temperature change nothing (plain decoding); the n-gram drafter proposes deterministically,
so its draft temperature changes nothing. Left as they are, one policy's traffic would be split
under several ids (`ngram-k4-t0` and `ngram-k4-t1`), and the tuner, which groups by id and by
policy, would measure one policy as several. `canonical` sets the ignored fields to their defaults;
`derived_id` names the canonical policy. The server derives an empty policy_id with it and the
tuner groups trials by the same rules (tuner.loop.space.policy_key).

Ids: "plain" (draft_length 0), "ngram-k<k>", "model-k<k>-t<T>" (T in the shortest exact form, %g);
an adaptive controller prefixes its name, and the moespec controller appends its cost weight:
"cascade-ngram-k8", "moespec-model-k8-t0-w1.5". The cost weight matters to the moespec controller
only; with draft_length 0 no controller has anything to choose (plain). A tree appends its width
("model-k6-t0.5-tw2"; draft_length is its node budget); a chain (width 1) appends nothing, and with
draft_length 0 there is no tree (plain).

A table (DraftPolicy.cells) appends each cell's label and id to its base's:
"plain+b1-1.greedy=ngram-k4+b2+.any=moespec-ngram-k8-w1"; an id longer than the proto allows is
shortened to "table-" and a digest of it.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace

from service.types import MAX_POLICY_ID_LENGTH, Controller, Drafter, DraftPolicy, PolicyCell, RequestKind

PLAIN_ID = "plain"


def is_plain(policy: DraftPolicy) -> bool:
    """Nothing is drafted (in no cell of a table): drafter and draft temperature have no effect."""
    return policy.longest_draft == 0


def temperature_matters(policy: DraftPolicy) -> bool:
    """The n-gram drafter proposes deterministically and plain decoding drafts nothing: both ignore
    the draft temperature; a drafter that samples its drafts uses it."""
    return not is_plain(policy) and policy.drafter is not Drafter.NGRAM


def canonical(policy: DraftPolicy) -> DraftPolicy:
    """The same policy with the fields its drafter ignores at their defaults (policy_id kept; a
    cell's policy_id, which nothing reads, cleared)."""
    if policy.cells:
        cells = tuple(replace(c, policy=replace(canonical(c.policy), policy_id="")) for c in policy.cells)
        return replace(canonical(replace(policy, cells=())), cells=cells)
    default = DraftPolicy()
    if is_plain(policy):
        policy = replace(policy, drafter=default.drafter, controller=default.controller,
                         tree_width=default.tree_width)
    if not temperature_matters(policy):
        policy = replace(policy, draft_temperature=default.draft_temperature)
    if policy.controller is not Controller.MOESPEC:
        policy = replace(policy, cost_weight=default.cost_weight)
    return policy


def derived_id(policy: DraftPolicy) -> str:
    """The id of the policy's canonical form: equal for policies that run the same way."""
    if policy.cells:
        full = _single_id(policy) + "".join(f"+{c.label}={_single_id(c.policy)}" for c in policy.cells)
        return full if len(full) <= MAX_POLICY_ID_LENGTH else "table-" + hashlib.sha1(full.encode()).hexdigest()[:16]
    return _single_id(policy)


def _single_id(policy: DraftPolicy) -> str:
    p = canonical(replace(policy, cells=()))
    if is_plain(p):
        return PLAIN_ID
    base = f"{p.drafter.value}-k{p.draft_length}"
    if temperature_matters(p):
        base += f"-t{p.draft_temperature:g}"
    if p.tree_width > 1:
        base += f"-tw{p.tree_width}"
    if p.controller is Controller.STATIC:
        return base
    if p.controller is Controller.MOESPEC:
        base += f"-w{p.cost_weight:g}"
    return f"{p.controller.value}-{base}"


_NUMBER = r"[0-9]+(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?"
_ADAPTIVE = "|".join(re.escape(c.value) for c in Controller if c is not Controller.STATIC)
_ID = re.compile(rf"(?:(?P<controller>{_ADAPTIVE})-)?(?P<drafter>{'|'.join(d.value for d in Drafter)})-k(?P<k>[0-9]+)"
                 rf"(?:-t(?P<t>{_NUMBER}))?(?:-tw(?P<tw>[0-9]+))?(?:-w(?P<w>{_NUMBER}))?")
_KINDS = "|".join(k.value for k in RequestKind)
_LABEL = re.compile(rf"b(?P<min>[0-9]+)(?:-(?P<max>[0-9]+)|\+)\.(?P<kind>{_KINDS})")


def policy_from_id(text: str) -> DraftPolicy:
    """The policy a derived id names ("plain", "ngram-k4", "moespec-model-k8-t0-w1.5",
    "model-k6-t0.5-tw2"; a model id without -t drafts at temperature 1); ValueError naming the expected
    form otherwise. A width the policy cannot have (a tree of the n-gram drafter) is left for
    DraftPolicy.validate to refuse, naming the field."""
    if text == PLAIN_ID:
        return DraftPolicy(policy_id="")
    m = _ID.fullmatch(text)
    if m is None or (m["w"] is not None and m["controller"] != Controller.MOESPEC.value):
        raise ValueError(f"{text!r} is not a policy id: expected plain, ngram-k<k>, model-k<k>[-t<T>][-tw<width>], "
                         "with an optional controller prefix (moespec-...-w<weight>, cascade-, sglang-ema-, "
                         "transformers-heuristic-)")
    default = DraftPolicy()
    return DraftPolicy(Drafter(m["drafter"]), int(m["k"]), float(m["t"]) if m["t"] else default.draft_temperature,
                       policy_id="", controller=Controller(m["controller"] or Controller.STATIC.value),
                       cost_weight=float(m["w"]) if m["w"] else default.cost_weight,
                       tree_width=int(m["tw"]) if m["tw"] else default.tree_width)


def cell_from_text(text: str) -> PolicyCell:
    """LABEL=ID ("b1-1.greedy=ngram-k4", "b9+.any=plain") -> the cell; ValueError when malformed."""
    label, sep, policy_id = text.partition("=")
    m = _LABEL.fullmatch(label)
    if not sep or m is None:
        raise ValueError(f"{text!r}: expected LABEL=POLICY_ID with LABEL b<min>-<max>.<kind> or b<min>+.<kind> "
                         f"(kind: {', '.join(k.value for k in RequestKind)}), e.g. b1-1.greedy=ngram-k4")
    return PolicyCell(policy_from_id(policy_id), int(m["min"]), int(m["max"] or 0), RequestKind(m["kind"]))
