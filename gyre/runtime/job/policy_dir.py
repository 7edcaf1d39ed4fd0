"""The run's latest policy as an HF-layout directory, `<run dir>/policy/`, that `python -m gyre.serve model_dir=...`
and `load_pretrained` load like the starting checkpoint (docs/runtime.md, "Outputs").

`write_policy(model, source_dir=, run_dir=, version=)` writes `config.json` and `model.safetensors`
(`gyre.models.hf_weights.save_pretrained`), the starting checkpoint's other files (tokenizer, chat template; its
config.json keys the model's own config lacks, such as `pad_token_id`), and `policy.json` (`{"version": v,
"source": <starting checkpoint>}`).

Contract: a reader sees the previous policy or the new one, never a mixture: the new directory is written beside
it (`.policy-<version>.tmp`), fsynced, and swapped in by two renames (a directory cannot be renamed over a
non-empty one); between them, for the time of one rename, `policy/` is absent and the previous policy is
`.policy-previous`, where a crash at that moment leaves it (the next write cleans it up). A failed write (a full
disk) raises OSError with the previous policy left in place and the temporary directory removed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

__all__ = ["POLICY_DIR", "POLICY_META", "copy_side_files", "write_policy"]

POLICY_DIR = "policy"
POLICY_META = "policy.json"
_PREVIOUS = ".policy-previous"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_WEIGHT_INDEX = "model.safetensors.index.json"


def copy_side_files(source_dir: Path, target: Path) -> None:
    """The source checkpoint's non-weight files; config.json merged: the written one wins, the source adds keys."""
    for path in sorted(source_dir.iterdir()):
        if not path.is_file() or path.name.endswith(_WEIGHT_SUFFIXES) or path.name == _WEIGHT_INDEX:
            continue
        if path.name == "config.json":
            written = json.loads((target / "config.json").read_text())
            source = json.loads(path.read_text())
            merged = {**source, **written}
            (target / "config.json").write_text(json.dumps(merged, indent=2) + "\n")
        elif path.name != POLICY_META:
            shutil.copy2(path, target / path.name)


def _fsync_dir(directory: Path) -> None:
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_policy(model, *, source_dir: Path, run_dir: Path, version: int) -> Path:
    """Write `model` (a `DecoderLM`) as policy `version` into `<run_dir>/policy/` (module docstring); its path."""
    from gyre.models.hf_weights import save_pretrained  # torch: only once a policy is written

    run_dir = Path(run_dir)
    target = run_dir / POLICY_DIR
    staging = run_dir / f".policy-{version}.tmp"
    previous = run_dir / _PREVIOUS
    shutil.rmtree(staging, ignore_errors=True)
    try:
        save_pretrained(model, staging)
        copy_side_files(Path(source_dir), staging)
        meta = {"version": version, "source": str(Path(source_dir).resolve())}
        (staging / POLICY_META).write_text(json.dumps(meta) + "\n")
        _fsync_dir(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(previous, ignore_errors=True)
    if target.exists():
        target.rename(previous)
    staging.rename(target)
    shutil.rmtree(previous, ignore_errors=True)
    return target
