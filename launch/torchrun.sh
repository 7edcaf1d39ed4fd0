#!/usr/bin/env bash
# Run the training program under torchrun: NPROC_PER_NODE ranks on this node (one per GPU), every rank running
# `python -m gyre.train` with the Hydra overrides given here (docs/cluster.md).
#
#   launch/torchrun.sh [hydra overrides...]                                  one node
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 RDZV_ID=exp1 launch/torchrun.sh ...   on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 RDZV_ID=exp1 launch/torchrun.sh ...   on node 1 (same overrides)
#
# Environment (default in brackets):
#   NNODES          nodes of the job [1]. NNODES x NPROC_PER_NODE must be cluster.num_cells x cluster.cell_size
#                   + cluster.separate_size (gyre exits 2 naming the fields otherwise).
#   NPROC_PER_NODE  ranks on this node, one per GPU [4: the CPU demo's 4 cells on one machine].
#   NODE_RANK       this node, 0 .. NNODES-1 [0]. Node 0 hosts torch's c10d rendezvous store at RDZV_ENDPOINT.
#                   The job's ranks are assigned by that rendezvous, not by NODE_RANK (torch orders the nodes by
#                   host name, then by the agent's pid): rank 0, gyre's controller, may run on any node.
#   MASTER_ADDR     node 0's address, reachable from every node [127.0.0.1].
#   MASTER_PORT     a free port on node 0 for the rendezvous [29500].
#   RDZV_ENDPOINT   host:port of the rendezvous [MASTER_ADDR:MASTER_PORT].
#   RDZV_ID         the job's id (torchrun --rdzv-id), the same on every node: required when NNODES > 1
#                   [gyre-<date>-<time>-<pid> on one node]. Workers see it as TORCHELASTIC_RUN_ID, which names the
#                   run directory (outputs/train/<RDZV_ID>, gyre.runtime.job.launch.fixed_run_dir_overrides); it stays
#                   the same when torchrun restarts the workers, so a restarted job comes back to its directory.
#   MAX_RESTARTS    how often torchrun restarts every worker of the job after one fails [0]. The restarted run
#                   starts in the same run directory and resumes from its latest complete checkpoint (RESUME).
#   RESUME          gyre's resume= [auto: the latest complete checkpoint of the run directory, afresh when there is
#                   none; docs/runtime.md, "Checkpoints and resume"]. A resume= override among the arguments wins.
#   RUN_DIR         the run directory of every rank (hydra.run.dir) [outputs/train/<RDZV_ID> under the current
#                   directory]. Multi-node: a path on a file system every node shares, where every rank's
#                   train.log lines go. A hydra.run.dir= override among the arguments wins.
#   PYTHON          the interpreter [the repository's .venv/bin/python if present, else python3].
#   TORCHRUN_ARGS   more torchrun options, split on spaces (e.g. "--log-dir torchrun-logs --tee 3").
#
# The exit status is torchrun's: 0 when every rank ended 0; otherwise torchrun prints which rank failed and why
# (exit code, or the signal), after gyre's own one-line error of the failed rank (exit 3 for a failed run).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
NNODES="${NNODES:-1}"
NPROC_PER_NODE="${NPROC_PER_NODE:-4}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ENDPOINT="${RDZV_ENDPOINT:-$MASTER_ADDR:$MASTER_PORT}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
if [[ -z "${RDZV_ID:-}" ]]; then
    if [[ "$NNODES" != 1 ]]; then
        echo "launch/torchrun.sh: NNODES=$NNODES: set RDZV_ID to the same job id on every node" >&2
        exit 2
    fi
    RDZV_ID="gyre-$(date +%Y%m%d-%H%M%S)-$$"
fi
if (( NODE_RANK == 0 )); then IS_HOST=true; else IS_HOST=false; fi

overrides=()
if [[ -n "${RUN_DIR:-}" ]]; then
    pinned=false
    for arg in "$@"; do [[ "$arg" == hydra.run.dir=* || "$arg" == +hydra.run.dir=* ]] && pinned=true; done
    $pinned || overrides+=("hydra.run.dir=$RUN_DIR")
fi
given_resume=false
for arg in "$@"; do [[ "$arg" == resume=* || "$arg" == +resume=* ]] && given_resume=true; done
$given_resume || overrides+=("resume=${RESUME:-auto}")
read -r -a extra <<< "${TORCHRUN_ARGS:-}"

exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$RDZV_ENDPOINT" \
    --rdzv-id "$RDZV_ID" \
    --rdzv-conf "is_host=$IS_HOST" \
    --max-restarts "$MAX_RESTARTS" \
    "${extra[@]}" \
    -m gyre.train "$@" "${overrides[@]}"
