"""The training runtime (docs/runtime.md): what joins the scheduler, the proxy, the harnesses, the buffers, the
trainer and the engines into one RL loop — the only package where engines and trainers meet.

Grouped by where the code runs:

- `job/`: the job as a whole — how it starts (`program`: a plain run, torchrun or srun), the run plan that checks
  a run once before any worker starts, the process groups and runtime store every rank opens (`spmd`), lifelines, nodes
  and their harness hosts, the run directory's checkpoints, resume and policy directory;
- `controller/`: rank 0 — the controller's loop (`loop`, the page to read first) and its parts (`episodes`, `cells`:
  transitions and publication, `steps`, `checkpoints`), the rank-0 set-up (`setup`) and the run's outputs;
- `cell/`: every cell — a satellite's loop (`worker`), a separate rollout pool rank's (`pool`), the engine a cell
  serves and the trainer it builds.

Beside them: `recipe` (what the runtime takes from a recipe: `Recipe`, `TaskSets`, `HeldOutSet`; the recipes live
in `gyre.recipes`, and the app `python -m gyre.train` picks one: this package imports neither), `task_sets` and
`held_out_tasks` (task directories a recipe or the config names), `ids` (the scheduler's integer ids <-> the string
ids of sessions, record files and outcomes), and `audit` (`python -m gyre.runtime.audit <run dir>`).
"""
