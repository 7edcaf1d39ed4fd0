"""The training runtime's pieces (docs/runtime.md): what joins the scheduler, the proxy, the harnesses, the buffers,
the trainer and the engines into one RL loop.

So far the near-pure glue of the controller, composed in one process by tests/integration/test_rl_loop.py:

- `ids`: the scheduler's integer execution and engine ids <-> the string ids of the proxy's sessions, the record
  files, the outcomes and the trajectory buffer;
- `verdicts`: an execution's evaluated outcome -> the scheduler's `Outcome`, and a closed group's admission into
  the trajectory buffer -> the buffers' verdict the scheduler hears (`group_accepted` / `group_rejected`);
- `local_claims`: lazy claims in one process (the scheduler's `claim_group`, the packer's pull, claim units).

The multi-process runtime and `python -m gyre.train` are still being built (docs/runtime.md).
"""
