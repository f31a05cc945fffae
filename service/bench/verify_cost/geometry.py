"""`Geometry`: the shape of a MoE model's decoder layers, the numbers a verify-cost measurement needs
(no weights): hidden size, routed experts and how many each token picks, their intermediate size, the
shared expert's (if any), how many MoE layers, and the attention heads and vocabulary for the whole pass."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Geometry:
    name: str
    hidden: int  # H
    experts: int  # E routed experts per layer
    top_k: int  # m experts each token picks
    expert_intermediate: int  # I of one routed expert (gate and up [I, H], down [H, I])
    shared_intermediate: int  # Is of the shared expert(s) together; 0 = none
    layers: int  # MoE layers of the whole model (dense layers before them are not counted)
    heads: int = 0  # attention query heads (0: no attention part known)
    kv_heads: int = 0
    head_dim: int = 0
    vocab: int = 0  # the output layer's rows (0: not known)

    def __post_init__(self):
        for name in ("hidden", "experts", "top_k", "expert_intermediate", "layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"geometry {self.name!r}: {name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.experts:
            raise ValueError(f"geometry {self.name!r}: top_k {self.top_k} exceeds the {self.experts} experts")
        if self.shared_intermediate < 0 or min(self.heads, self.kv_heads, self.head_dim, self.vocab) < 0:
            raise ValueError(f"geometry {self.name!r}: sizes must not be negative")
        if self.heads and (not self.kv_heads or not self.head_dim or self.heads % self.kv_heads):
            raise ValueError(f"geometry {self.name!r}: {self.heads} heads need kv heads dividing them and a head dim")

    @property
    def has_attention(self) -> bool:
        return self.heads > 0

    def expert_params(self) -> int:
        """One routed expert's weights: gate and up [I, H] and down [H, I]."""
        return 3 * self.hidden * self.expert_intermediate

    def layer_params(self, attention: bool = False) -> int:
        """One MoE layer's weights: the routed experts, the router [E, H], the shared expert, and with
        `attention` the q/k/v/o projections."""
        n = self.experts * self.expert_params() + self.experts * self.hidden
        n += 3 * self.hidden * self.shared_intermediate
        if attention:
            n += self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return n

    def uniform_union(self, window: float) -> float:
        """Expected distinct experts per layer for `window` positions under uniform routing."""
        return self.experts * (1 - (1 - self.top_k / self.experts) ** window)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Geometry:
        return cls(**data)
