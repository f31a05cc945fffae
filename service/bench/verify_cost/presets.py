"""Published shapes of public MoE models (numbers only: no weights are shipped or fetched), by the name
`--geometry` takes. `target` is the shipped model's own geometry, read from its config.json.

Sources: each model's published HuggingFace config.json. Layers count the MoE layers only (DeepSeek-V3
and Ling-mini-2.0 start with dense layers). DeepSeek-V3's attention is MLA; its heads here are only the
query-head count, and its attention part is not modelled (heads 0)."""

from __future__ import annotations

from pathlib import Path

from service.bench.verify_cost.geometry import Geometry
from service.bench.verify_cost.hf_config import geometry_from_config_file

PRESETS: dict[str, Geometry] = {g.name: g for g in (
    Geometry("qwen3-30b-a3b", hidden=2048, experts=128, top_k=8, expert_intermediate=768, shared_intermediate=0,
             layers=48, heads=32, kv_heads=4, head_dim=128, vocab=151936),
    Geometry("qwen2-57b-a14b", hidden=3584, experts=64, top_k=8, expert_intermediate=2560, shared_intermediate=20480,
             layers=28, heads=28, kv_heads=4, head_dim=128, vocab=151936),
    Geometry("deepseek-v3", hidden=7168, experts=256, top_k=8, expert_intermediate=2048, shared_intermediate=2048,
             layers=58, vocab=129280),
    Geometry("mixtral-8x7b", hidden=4096, experts=8, top_k=2, expert_intermediate=14336, shared_intermediate=0,
             layers=32, heads=32, kv_heads=8, head_dim=128, vocab=32000),
    Geometry("olmoe-1b-7b", hidden=2048, experts=64, top_k=8, expert_intermediate=1024, shared_intermediate=0,
             layers=16, heads=16, kv_heads=16, head_dim=128, vocab=50304),
    Geometry("ling-mini-2.0", hidden=2048, experts=256, top_k=8, expert_intermediate=512, shared_intermediate=512,
             layers=19, heads=16, kv_heads=4, head_dim=128, vocab=157184),
)}

TARGET = "target"  # the shipped model: service/models/target/config.json


def target_config_path() -> Path:
    return Path(__file__).resolve().parents[2] / "models" / "target" / "config.json"


def resolve_geometry(name_or_path: str) -> Geometry:
    """A preset name, `target`, or a path to a HuggingFace config.json."""
    if name_or_path == TARGET:
        return geometry_from_config_file(target_config_path(), name=TARGET)
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        return geometry_from_config_file(path)
    raise ValueError(f"--geometry {name_or_path!r}: not a preset ({', '.join([TARGET, *PRESETS])}) "
                     "nor a config.json path")
