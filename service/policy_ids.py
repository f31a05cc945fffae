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
only; with draft_length 0 no controller has anything to choose (plain).
"""

from __future__ import annotations

from dataclasses import replace

from service.types import Controller, Drafter, DraftPolicy

PLAIN_ID = "plain"


def is_plain(policy: DraftPolicy) -> bool:
    """Nothing is drafted: drafter and draft temperature have no effect."""
    return policy.draft_length == 0


def temperature_matters(policy: DraftPolicy) -> bool:
    """The n-gram drafter proposes deterministically and plain decoding drafts nothing: both ignore
    the draft temperature; a drafter that samples its drafts uses it."""
    return not is_plain(policy) and policy.drafter is not Drafter.NGRAM


def canonical(policy: DraftPolicy) -> DraftPolicy:
    """The same policy with the fields its drafter ignores at their defaults (policy_id kept)."""
    default = DraftPolicy()
    if is_plain(policy):
        policy = replace(policy, drafter=default.drafter, controller=default.controller)
    if not temperature_matters(policy):
        policy = replace(policy, draft_temperature=default.draft_temperature)
    if policy.controller is not Controller.MOESPEC:
        policy = replace(policy, cost_weight=default.cost_weight)
    return policy


def derived_id(policy: DraftPolicy) -> str:
    """The id of the policy's canonical form: equal for policies that run the same way."""
    p = canonical(policy)
    if is_plain(p):
        return PLAIN_ID
    base = f"{p.drafter.value}-k{p.draft_length}"
    if temperature_matters(p):
        base += f"-t{p.draft_temperature:g}"
    if p.controller is Controller.STATIC:
        return base
    if p.controller is Controller.MOESPEC:
        base += f"-w{p.cost_weight:g}"
    return f"{p.controller.value}-{base}"
