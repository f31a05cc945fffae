"""A draft head's drafting chain, or its draft tree, for one sequence in one C call.

Why: one drafting round of the head is ~15 small torch ops and four kernel calls (norms, the input
projection, attention, the MLP, the output layer, then softmax and sampling); their dispatch cost
more than their arithmetic, and a round ran once per drafted token. Here every round after the
catch-up pass runs inside one call, so a drafted token costs its arithmetic.

Contract of `head_draft` (csrc/head.c, compiled into library.py's library; it uses `rms_norm`,
`matmul_p`, `attention_block` and `swiglu_experts` from the files before it):
- The catch-up: the m entries a sequence's head cache lacks (committed tokens [m], each with the
  target's true feature one position back [m, H]) at positions start..start+m-1 of cache slot
  `slot`, keys and values written; the last one's output gives the logits of draft 0.
- Then for j = 1..k-1 the head runs on (its own last feature, draft j-1) at position start+m+j-1
  and draft j is picked from its logits.
- A pick at temperature 0 is the first maximum of the logits; at temperature T > 0 it is drawn from
  softmax(logits / T) by inverse CDF with the given uniform u_j in [0, 1), and that distribution is
  written to q [k, Vd] (what the acceptance rule needs). Picks are draft-vocabulary indices.
- The arithmetic of each round is the same as `DraftHead.forward_ragged`'s kernel path on one row,
  so the chain's drafts do not depend on which path ran them.

Contract of `head_tree` (csrc/head_tree.c; spec/tree_drafting.py says why): the same catch-up, then a
top-candidate tree of at most `budget` nodes grown best first: every expanded node (the root first)
offers its `width` likeliest draft indices as children, scored by path log-probability at the
temperature of their depth (`taus`); the best child not yet expanded runs next (one head row at the
next free position past the root, attending the prefix and its path: a tree pass of attention.py)
while it scores at least the budget-th best child so far; the tree is the `budget` best children,
returned by depth then offer order with parents as node indices (-1: the root).

Contract of `head_greedy_steps` (csrc/spec_steps.c, library.py's `Kernels.head_greedy_steps`): up to
`steps` greedy speculative steps of one sequence, each `head_draft`'s catch-up and chain at temperature 0,
`forward_logits` over [last token, drafts] (`SpecTarget`: the target's side, whose final features go
where the next catch-up reads them), the greedy verdict and the commit; it returns `HeadSteps`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


class HeadWeights(ctypes.Structure):
    """The C `struct head_weights`: pointers into a loaded head's tensors (which must stay alive)."""

    _fields_ = [*((n, _I64) for n in ("H", "I", "Vd", "A", "K", "D", "S", "V", "slots")), ("eps", _F), ("embed", _P),
                *((n, _P) for n in ("embed_norm_w", "feature_norm_w", "attn_norm_w", "post_norm_w", "final_norm_w")),
                ("fc_wt", _P), ("fc_fmt", _INT), ("qkv_wt", _P), ("qkv_b", _P), ("o_wt", _P), ("attn_fmt", _INT),
                ("gate_up_t", _P), ("down_t", _P), ("mlp_fmt", _INT), ("lm_wt", _P), ("lm_fmt", _INT),
                ("vocab", _P), ("rope_cos", _P), ("rope_sin", _P), ("k_cache", _P), ("v_cache", _P)]


class SpecTarget(ctypes.Structure):
    """head.h's struct spec_target, field for field: the target's side of `head_greedy_steps`."""

    _fields_ = [("layers", _P), ("head", _P), *((n, _I64) for n in ("H", "V", "L", "m", "S", "layer_floats")),
                ("rope_cos", _P), ("rope_sin", _P), ("k_cache", _P), ("v_cache", _P), ("features", _P)]


@dataclass(frozen=True)
class HeadSteps:
    """What `head_greedy_steps` ran, per step: the drafts, which matched the target's argmax, how many
    were accepted, the target's next token, the pass's routed ids [L, w, m] and (drafting, target pass
    and verdict) seconds."""

    drafts: list[list[int]]
    matches: list[tuple[bool, ...]]
    accepted: list[int]
    bonus: list[int]
    routed: list[torch.Tensor]
    seconds: list[tuple[float, float]]
