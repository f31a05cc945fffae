"""Expert-parallel (EP) view of the SGLang backend's verify windows: `--ep-size P [--ep-placement FILE]`.

The counting is service/routing/expert_parallel.py's; this module decides what it is fed. What is real and
what is modelled:
- Real: every token-expert pair of the window and the physical slot SGLang sent it to (the
  recorder's `topk_ids_of_layer`, physical ids), and the physical-to-logical map SGLang ran with
  (the dump's `last_physical_to_logical_map`, its EPLB state: the identity [L, E] on a server
  without EPLB or redundant experts, as on the CPU in CI, which runs SGLang with ep_size 1).
- Without --ep-placement the recorded slots are split into P contiguous rank blocks, slot s on rank
  s // (S / P), as SGLang lays slots over its EP ranks (`view_from_physical`). When SGLang itself
  runs with ep_size P this is its real rank layout and the view is measured; when it runs on one
  device (ep_size 1) the P ranks are hypothetical: where the same slots would live on P ranks.
- With --ep-placement FILE the recorded slots are read back to logical experts through SGLang's map
  and dispatched by the file's placement (expert_parallel's rule: the replica on the home rank,
  else the lowest-ranked one). Modelled: SGLang did not run with that placement.
- Modelled in both: every position's home is rank 0 (one request per pass here, as for the embedded
  engine; under DP attention it would be the request's attention rank), and bytes are pairs x hidden
  x 2 (bf16 activations, what an EP deployment sends, whatever dtype the server computes in).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service.routing.expert_parallel import (
    EPSpec,
    PassView,
    Placement,
    PlacementError,
    contiguous_map,
    make_placement,
    pass_view,
    view_from_physical,
)
from service.sglang_backend.attribution import Window
from service.sglang_backend.model_config import MoeGeometry


@dataclass(frozen=True)
class EPConfig:
    size: int  # P
    bytes_per_token: int  # hidden size x activation bytes
    target: MoeGeometry
    placement: Placement | None = None  # --ep-placement over the MoE layers; None: SGLang's own slots


def ep_config(spec: EPSpec, target: MoeGeometry) -> EPConfig:
    """Check an EP request against the model at start-up (PlacementError names what does not fit).

    A placement file may have SGLang's shape (a row per decoder layer, dense ones included) or one
    row per MoE layer; only the MoE layers' rows are used.
    """
    placement = None
    moe = list(target.moe_layers)
    if spec.physical_to_logical is not None:
        p2l = spec.physical_to_logical
        if p2l.dim() == 2 and p2l.shape[0] == target.num_hidden_layers != len(moe):
            p2l = p2l[moe]
        placement = make_placement(spec.size, len(moe), target.num_experts, p2l)
    elif target.num_experts % spec.size:
        # SGLang's map has E slots per layer unless it runs redundant experts.
        raise PlacementError(f"{target.num_experts} experts per layer do not split into {spec.size} equal ranks")
    return EPConfig(spec.size, target.hidden_size * spec.dtype_bytes, target, placement)


def window_view(window: Window, config: EPConfig) -> PassView:
    """The EP view of one request's verify window (its MoE layers). Raises PlacementError when the
    map SGLang ran with has a slot count P does not divide (redundant experts)."""
    moe = list(config.target.moe_layers)
    if config.placement is not None:
        return pass_view(config.placement, window.topk_ids[moe], config.bytes_per_token)
    p2l = window.physical_to_logical
    if p2l is None:  # a dump without a map: SGLang's default, the identity
        p2l = contiguous_map(config.target.num_hidden_layers, config.target.num_experts)
    return view_from_physical(window.physical_ids[moe], torch.as_tensor(p2l)[moe], config.size,
                              config.bytes_per_token)
