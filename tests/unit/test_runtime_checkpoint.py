"""A run's checkpoints on disk (gyre/runtime/job/checkpoint.py) and the group outcomes they keep
(gyre/traj/outcomes_state.py).

- Group outcomes go through JSON and come back equal: statuses, rewards, members, the order they became valid; an
  execution given a new id comes back OPEN.
- A checkpoint is read back with its state, the optimizer files its ranks wrote into its staging directory listed
  in `complete.json`; the newest complete one is taken; one cut off mid-write (a real
  SIGKILL of the writing process), a `step-<n>/` without `complete.json` and one whose file lost bytes are skipped
  for the previous one; `keep` prunes the oldest; a write into a directory that cannot be written raises
  `CheckpointError` and leaves nothing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.models.decoder import DecoderLM
from gyre.models.decoder_config import DecoderConfig
from gyre.runtime.job.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    optimizer_file,
    read_checkpoint,
    stage_checkpoint,
    write_checkpoint,
)
from gyre.runtime.job.resume import ResumeError, checkpoint_to_resume
from gyre.traj.outcomes import CloseKind, EvaluatedState, Evaluation, GroupOutcomes, Status, Validity
from gyre.traj.outcomes_state import group_outcomes_state, restored_group_outcomes

TINY = dict(model_type="qwen3", vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8)  # fmt: skip


def evaluation(execution: str, score: float, attempt: int = 1, validity=Validity.VALID) -> Evaluation:
    state = EvaluatedState(execution=execution, artifact_version="final", branch="main")
    return Evaluation(score=score, validity=validity, state=state, attempt=attempt, evaluator="demo",
                      evaluator_version="1", created_at=2.0)  # fmt: skip


def test_group_outcomes_come_back_from_json_as_they_were():
    names = ["a", "b", "c", "d"]
    group = GroupOutcomes(2, names)
    for name in names[:3]:
        group.start(name, 100.0)
    final = EvaluatedState(execution="b", artifact_version="final", branch="main")
    group.record(evaluation("b", 0.0, validity=Validity.FAILED))
    group.close("b", CloseKind.COMPLETED, now=3.0, final_state=final)
    group.record(evaluation("b", 0.75, attempt=2))
    group.close("a", CloseKind.FAILED, now=4.0)
    state = json.loads(json.dumps(group_outcomes_state(group)))
    back = restored_group_outcomes(state, names)
    assert back.ready and back.members == group.members == ("a", "b")
    assert back.rewards() == group.rewards() == {"a": 0.0, "b": 0.75}
    assert [back.execution(n).status for n in names] == [group.execution(n).status for n in names]
    assert back.execution("b").evaluations == group.execution("b").evaluations

    open_group = GroupOutcomes(2, ["x", "y"])
    open_group.start("x", 50.0)
    open_group.close("x", CloseKind.FAILED, now=1.0)
    open_group.start("y", 50.0)  # running when the checkpoint was taken: run again as "y-r1"
    again = restored_group_outcomes(group_outcomes_state(open_group), ["x", "y-r1"])
    assert again.execution("x").status is Status.PLACEHOLDER
    assert again.execution("y-r1").status is Status.OPEN and not again.ready


def write(run_dir: Path, step: int, keep: int = 5) -> Path:
    """Checkpoint `step` as the controller writes one of a core of two ranks: staged, each rank's optimizer file
    written there, then the rest."""
    model = DecoderLM(DecoderConfig(**TINY))
    source = run_dir / "source"
    source.mkdir(exist_ok=True)
    (source / "tokenizer.json").write_text("{}")
    state = {"scheduler": {"trainer_version": step, "published_version": step}, "step": step}
    trainer_dir = stage_checkpoint(run_dir, step)
    for coordinate in (0, 1):
        torch.save({"optimizer": {}, "coordinate": coordinate}, trainer_dir / optimizer_file(coordinate, 2))
    return write_checkpoint(run_dir, step, state, trainer_model=model, source_dir=source, keep=keep,
                            staged=True)  # fmt: skip


def test_the_newest_complete_checkpoint_is_read_and_torn_ones_are_skipped(tmp_path, caplog):
    write(tmp_path, 2)
    newest = write(tmp_path, 4)
    assert latest_checkpoint(tmp_path).step == 4
    assert read_checkpoint(newest).state["step"] == 4
    assert (newest / "trainer" / "tokenizer.json").is_file()
    listed = json.loads((newest / "complete.json").read_text())["files"]
    assert {"trainer/optimizer-0.pt", "trainer/optimizer-1.pt"} <= set(listed)  # the ranks' files count for complete
    assert torch.load(newest / "trainer" / "optimizer-1.pt")["coordinate"] == 1
    weights = newest / "trainer" / "model.safetensors"
    with open(weights, "r+b") as handle:  # a file that lost its end
        handle.truncate(weights.stat().st_size - 10)
    assert latest_checkpoint(tmp_path).step == 2
    assert "skipped" in caplog.text
    fake = tmp_path / "checkpoints" / "step-000009"  # a directory without complete.json
    fake.mkdir()
    (fake / "state.json").write_text("{}")
    assert latest_checkpoint(tmp_path).step == 2
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        read_checkpoint(fake)


WRITER = """
import os, signal, sys
from pathlib import Path
import gyre.runtime.job.checkpoint as checkpoint
sys.path.insert(0, {tests!r})
from test_runtime_checkpoint import write
real = checkpoint.copy_side_files
def killed(source, target):  # the writer dies with the weights half done: after trainer/, before state.json
    real(source, target)
    os.kill(os.getpid(), signal.SIGKILL)
checkpoint.copy_side_files = killed
write(Path({run_dir!r}), 6)
"""


def test_a_checkpoint_cut_off_by_sigkill_mid_write_is_skipped_for_the_previous_one(tmp_path):
    write(tmp_path, 3)
    code = WRITER.format(tests=str(Path(__file__).parent), run_dir=str(tmp_path))
    process = subprocess.run([sys.executable, "-c", code], timeout=120, capture_output=True, text=True)
    assert process.returncode == -signal.SIGKILL, process.stderr
    assert (tmp_path / "checkpoints" / ".step-000006.tmp").is_dir()  # what the kill left
    assert latest_checkpoint(tmp_path).step == 3
    assert checkpoint_to_resume("auto", tmp_path).step == 3


def test_keep_prunes_the_oldest_and_resume_never_refuses_a_directory_with_checkpoints(tmp_path):
    for step in (1, 2, 3):
        write(tmp_path, step, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-000002", "step-000003"]
    with pytest.raises(ResumeError, match="resume=auto continues"):
        checkpoint_to_resume("never", tmp_path)
    assert checkpoint_to_resume("never", tmp_path / "fresh") is None
    with pytest.raises(ResumeError, match="not a complete checkpoint"):
        checkpoint_to_resume(str(tmp_path / "checkpoints"), tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_checkpoint_that_cannot_be_written_raises_and_leaves_nothing(tmp_path):
    write(tmp_path, 1)
    root = tmp_path / "checkpoints"
    root.chmod(0o500)
    try:
        with pytest.raises(CheckpointError, match="not written"):
            write(tmp_path, 2)
    finally:
        root.chmod(0o700)
    assert sorted(p.name for p in root.iterdir()) == ["step-000001"]


def test_a_full_disk_raises_and_leaves_nothing(tmp_path, monkeypatch):
    import gyre.runtime.job.checkpoint as checkpoint

    write(tmp_path, 1)

    def full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "copy_side_files", full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        write(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]
