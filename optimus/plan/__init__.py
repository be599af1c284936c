"""Plan a run before asking for nodes: cluster presets, per-rank memory, step time, energy, layout search."""
