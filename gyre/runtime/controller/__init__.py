"""Rank 0's part of the job: the controller's loop (`loop.py`, the page to read first) and its parts, each named for
what it does: episodes, cell transitions and publication, training steps, checkpoints, the rank-0 set-up and the
run's outputs; the proxy's front, the other nodes' harness hosts, the held-out evaluation, the role trace
(docs/runtime.md, "The controller")."""
