"""The model wing: the Qwen2-MoE decoder, its layers and config, weights on disk, the draft head."""
