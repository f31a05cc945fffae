"""`moespec bench verify-cost`: cost(w, U) of verify windows on a real MoE geometry, a fitted cost model,
and the profile file the what-if replay reads.

- `geometry`, `presets`, `hf_config`: the shape measured (published presets, or a HuggingFace config.json).
- `windows`: windows of w positions whose tokens touch exactly U distinct experts per layer.
- `memory`: refuses a measurement whose weights would not fit before allocating them.
- `fused_cpu` (the engine's fused CPU kernel), `torch_layers` (plain torch, any device): the layers timed.
- `measure`: interleaved rounds; `fit`: the least-squares cost model and its held-out error.
- `report`: table, JSON, PNG; `profile`: reading the profile back (the what-if's side).
- `command`: the command line.
"""
