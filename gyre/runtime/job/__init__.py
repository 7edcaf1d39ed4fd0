"""The job as a whole: how it starts (`program.py`: a plain run, torchrun or srun; `launch.py`), the run plan: every
check of the config and the filesystem, once, before any worker starts (`plan.py`), the process groups and the runtime
store every rank opens (`spmd.py`), ranks watching each other (`lifeline.py`), nodes and their harness hosts
(`nodes.py`, `harness_host.py`), the harness and sandbox a rank builds (`harness_setup.py`), and the run directory's
checkpoints, resume and policy directory (`checkpoint.py`, `resume.py`, `policy_dir.py`; docs/runtime.md)."""
