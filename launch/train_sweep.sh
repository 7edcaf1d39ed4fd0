#!/usr/bin/env bash
# Sweep the real program over the staleness knobs: phi in {0, 0.5, 1} x mu in {1, 2, 3} (9 runs, one Hydra multirun
# of python -m gyre.train, one run after another, each launching its own workers), then print one row per run:
# the target phi + (mu - 1) / 2 (Theorem A.1), the measured group-weighted mean staleness after the warm-up steps,
# the token-weighted mean, the maximum, the mean step time and the run's total time.
#
#   launch/train_sweep.sh [hydra overrides...]     e.g. launch/train_sweep.sh steps=12 tasks.demo.work.enabled=true
#
# Overrides apply to every run (phi * B must be a whole number of groups for every phi: B even here). Outputs:
# $SWEEP_DIR/<job>/ (a run directory each: summary.json, metrics.jsonl, ...; default
# multirun/train_sweep/<date>_<time>). PYTHON selects the interpreter (default .venv/bin/python); PHIS and MUS the
# values (default "0,0.5,1" and "1,2,3").
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
SWEEP_DIR="${SWEEP_DIR:-multirun/train_sweep/$(date +%Y-%m-%d_%H-%M-%S)}"
PHIS="${PHIS:-0,0.5,1}"
MUS="${MUS:-1,2,3}"
mkdir -p "$(dirname "$SWEEP_DIR")"

"$PYTHON" -m gyre.train -m "algo.phi=$PHIS" "algo.mu=$MUS" "hydra.sweep.dir=$SWEEP_DIR" "$@" > "$SWEEP_DIR.log" 2>&1 \
    || { echo "the sweep failed: see $SWEEP_DIR.log" >&2; exit 1; }

"$PYTHON" - "$SWEEP_DIR" <<'PY'
import json
import sys
from pathlib import Path

rows = [json.loads(path.read_text()) for path in Path(sys.argv[1]).glob("*/summary.json")]
print(f"{'phi':>5} {'mu':>3} {'target':>6} {'group':>6} {'token':>6} {'max':>4} {'|err|':>6} {'step s':>7} {'total s':>8}")
worst = 0.0
for s in sorted(rows, key=lambda s: (s["phi"], s["mu"])):
    st = s["staleness"]
    target = s["phi"] + (s["mu"] - 1) / 2
    group = st["group_mean"]
    err = None if group is None else abs(group - target)
    worst = max(worst, err or 0.0)
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    steps = s["step_times_s"]
    print(
        f"{s['phi']:>5g} {s['mu']:>3} {target:>6.2f} {fmt(group):>6} {fmt(st['token_mean']):>6} "
        f"{fmt(st['max']):>4} {fmt(err):>6} {sum(steps) / len(steps):>7.1f} {s['total_time_s']:>8.1f}"
    )
print(f"{len(rows)} runs in {sys.argv[1]}; largest |group mean - target| {worst:.3f}")
PY
