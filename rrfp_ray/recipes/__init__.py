"""Recipes: what one job needs beyond the library, above `train/` (the GPT run: its config, workload, flags and
report)."""
