"""Observability: what a gyre run reports while it runs and after it.

Logging setup (`logging`), the role-timeline picture (`timeline`), the per-step metrics record (`record`), the metric
sinks and their fan-out (`sinks`: JSONL, W&B, memory; the only module of gyre that imports wandb), the console
progress line (`progress`) and `summary.json` (`summary`). docs/runtime.md, "Outputs".
"""
