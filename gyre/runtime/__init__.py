"""The training runtime's pieces (docs/runtime.md): what joins the scheduler, the proxy, the harnesses, the buffers,
the trainer and the engines into one RL loop — the only package where engines and trainers meet.

Among them:

- `launch`: how the SPMD job starts (torchrun, srun, or a plain run launching its own workers);
- `ids`: the scheduler's integer execution and engine ids <-> the string ids of the proxy's sessions, the record
  files, the outcomes and the trajectory buffer;
- `verdicts`: an execution's evaluated outcome -> the scheduler's `Outcome`, and a closed group's admission into
  the trajectory buffer -> the buffers' verdict the scheduler hears (`group_accepted` / `group_rejected`);
- `local_claims`: lazy claims in one process (the scheduler's `claim_group`, the packer's pull, claim units),
  composed with the rest by tests/integration/test_rl_loop.py;
- `transitions`: a cell's engine leaving rollout (`leave_rollout`: stop accepting, drain, release) and returning with
  the core's publication (`return_to_rollout`: resume, load the published version, then accept), and the publication
  to the engines that stayed (`publish_to_engines`);
- `program`, `controller`, `cell_worker`, `job`: the SPMD job itself (docs/runtime.md, "The program");
- `recipe`: what the runtime takes from a recipe (`Recipe`: a starting model, `TaskSets`, checks); the recipes live
  in `gyre.recipes` and the app `python -m gyre.train` (`gyre.train.app`) picks one. This package imports none.
"""
