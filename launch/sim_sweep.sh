#!/usr/bin/env bash
# Sweep the simulator over the staleness knobs: phi in {0, 0.5, 1, 1.5, 2} x mu in {1, 2, 3, 4}
# (20 jobs, one Hydra multirun), then print one row per job.
#
#   launch/sim_sweep.sh [hydra overrides...]     e.g. launch/sim_sweep.sh experiment=E2 seed=1
#
# Overrides apply to every job. Colocate needs phi = 0, so sweep elastic or async modes only.
# Outputs: $SWEEP_DIR/<job>/{summary.json,role_timeline.png,config.yaml}
# (default multirun/sim_sweep/<date>_<time>). PYTHON selects the interpreter (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
SWEEP_DIR="${SWEEP_DIR:-multirun/sim_sweep/$(date +%Y-%m-%d_%H-%M-%S)}"

"$PYTHON" -m gyre.sim -m 'algo.phi=0,0.5,1,1.5,2' 'algo.mu=1,2,3,4' "hydra.sweep.dir=$SWEEP_DIR" "$@" >/dev/null

"$PYTHON" - "$SWEEP_DIR" <<'PY'
import json
import sys
from pathlib import Path

rows = [json.loads(p.read_text()) for p in Path(sys.argv[1]).glob("*/summary.json")]
print(f"{'phi':>5} {'mu':>3} {'E[d]':>5} {'hours':>8} {'staleness':>9} {'rollout':>8} {'training':>8}")
for s in sorted(rows, key=lambda s: (s["phi"], s["mu"])):
    st, ut = s["staleness"], s["utilization"]
    mean = "-" if st["group_mean"] is None else f"{st['group_mean']:.2f}"
    print(
        f"{s['phi']:>5g} {s['mu']:>3} {st['target']:>5g} {s['total_time_h']:>8.2f} {mean:>9} "
        f"{ut['rollout']:>8.2f} {ut['training']:>8.2f}"
    )
print(f"{len(rows)} runs in {sys.argv[1]}")
PY
