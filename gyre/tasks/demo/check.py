"""The demo family's hidden check: the last integer in the workspace's answer file against the expected one.

`score_answer(workspace, hidden_dir) -> 1.0 | 0.0`. The expected answer lives in `hidden/expected.json`
(`{"answer": "<int>", "answer_file": "answer.txt"}`), which is never copied into the workspace. The answer
file may hold the bare number or a sentence ("The result is 6713."): the last integer counts, with `,` and
`_` digit separators allowed. A missing or unreadable answer file is a valid 0.0 (the agent did not answer).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["EXPECTED_FILE", "read_answer", "score_answer"]

EXPECTED_FILE = "expected.json"
MAX_ANSWER_BYTES = 4096  # only the start of an answer file is read: the check stays fast whatever was written
_INTEGER = re.compile(r"-?\d+(?:[,_]\d{3})*")


def read_answer(text: str) -> int | None:
    """The last integer in `text`, or None."""
    found = _INTEGER.findall(text)
    return int(re.sub(r"[,_]", "", found[-1])) if found else None


def score_answer(workspace: Path, hidden_dir: Path | None) -> float:
    if hidden_dir is None:
        raise ValueError("the demo check needs the task's hidden/ directory")
    expected = json.loads((Path(hidden_dir) / EXPECTED_FILE).read_text(encoding="utf-8"))
    answer_path = Path(workspace) / expected.get("answer_file", "answer.txt")
    if not answer_path.is_file():
        return 0.0
    with answer_path.open("rb") as f:
        text = f.read(MAX_ANSWER_BYTES).decode("utf-8", errors="replace")
    return 1.0 if read_answer(text) == int(expected["answer"]) else 0.0
