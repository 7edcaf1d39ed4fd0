"""Every cell's part of the job: a satellite's loop (`worker.py`) and a separate rollout pool rank's (`pool.py`),
the engine a cell serves (`engines.py`) and the trainer it builds (`trainers.py`, `trainer_thread.py`); rank 0, the
core's first rank, builds its engine and trainer with the same functions (docs/runtime.md, "The process model")."""
