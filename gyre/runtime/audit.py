"""What the harnesses of a finished run saw, counted from their own logs: `python -m gyre.runtime.audit <run dir>`
(docs/runtime.md, "Auditing a run").

The run's promise to its harnesses is that scheduling is invisible to them: no API error, no retry and no timeout
caused by the proxy or a role change, and every model call recorded exactly once. This reads, for each execution
under `<run dir>/executions/`, the builtin harness's own transcript (`home/transcript.jsonl`: its `retry` events
and its `end` event's status), and checks the run's record files (`records/*.jsonl`: calls, request ids distinct)
against the proxy's own counters (the `proxy: calls {...}` line the program logs in `train.log`).

Output (one JSON object): `executions`; `ends` (the harnesses' end statuses: `answered`, `max_turns`, `error`,
and `none` for a harness that wrote no end: stopped by its timeout or cancelled); `retries` and
`retry_errors` (the first few messages); `api_errors` (ends with status `error`, and their messages);
`calls_recorded` and `duplicate_request_ids` (record files); `proxy` (its counters); `outcomes` (the
scheduler's, from `summary.json`: `harness_timeout` is the harnesses that ran out of budget; an execution the run
cancelled at its end wrote no end and is not one). Harnesses other than the builtin one keep other logs: their
executions count under `no_transcript`.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["audit_run", "main"]

TRANSCRIPT = Path("home") / "transcript.jsonl"
KEEP_MESSAGES = 5


def _events(path: Path) -> list[dict]:
    events = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a killed harness
    return events


def proxy_counters(train_log: Path) -> dict[str, int] | None:
    """The last `proxy: calls {...}` line of the run's log, or None."""
    if not train_log.is_file():
        return None
    found = None
    for line in train_log.read_text(encoding="utf-8", errors="replace").splitlines():
        if "proxy: calls " in line:
            try:
                found = json.loads(line.split("proxy: calls ", 1)[1])
            except ValueError:
                continue
    return found


def audit_run(run_dir: Path) -> dict[str, Any]:
    """The counts of the module docstring for the run in `run_dir`."""
    from gyre.traj.store import load_tree

    run_dir = Path(run_dir)
    ends: Counter[str] = Counter()
    retries, retry_errors, api_errors, no_transcript, executions = 0, [], [], 0, 0
    for execution in sorted((run_dir / "executions").glob("*")):
        if not execution.is_dir():
            continue
        executions += 1
        transcript = execution / TRANSCRIPT
        if not transcript.is_file():
            no_transcript += 1
            continue
        end = None
        for event in _events(transcript):
            if event.get("event") == "retry":
                retries += 1
                if len(retry_errors) < KEEP_MESSAGES:
                    retry_errors.append(f"{execution.name}: {event.get('error')}")
            elif event.get("event") == "end":
                end = event
        status = end.get("status", "none") if end else "none"
        ends[status] += 1
        if status == "error" and len(api_errors) < KEEP_MESSAGES:
            api_errors.append(f"{execution.name}: {end.get('error')}")
    calls, duplicates = 0, 0
    for path in sorted((run_dir / "records").glob("*.jsonl")):
        tree = load_tree(path)
        ids = [call.meta.request_id for call in tree.calls]
        calls += len(ids)
        duplicates += len(ids) - len(set(ids))
    return {
        "executions": executions,
        "no_transcript": no_transcript,
        "ends": dict(ends),
        "retries": retries,
        "retry_errors": retry_errors,
        "api_errors": ends.get("error", 0),
        "api_error_messages": api_errors,
        "calls_recorded": calls,
        "duplicate_request_ids": duplicates,
        "proxy": proxy_counters(run_dir / "train.log"),
        "outcomes": _summary_outcomes(run_dir / "summary.json"),
    }


def _summary_outcomes(path: Path) -> dict | None:
    """The scheduler's closed executions by outcome (`summary.json`): `harness_timeout` counts the harnesses that
    ran out of their budget, and cancellations at the run's end are not among them."""
    try:
        return json.loads(path.read_text()).get("outcomes")
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not Path(args[0]).is_dir():
        print("usage: python -m gyre.runtime.audit <run dir> (one python -m gyre.train wrote)", file=sys.stderr)
        return 2
    print(json.dumps(audit_run(Path(args[0])), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
