"""The run's policies: `<run dir>/policies/v<version>/`, each a complete HF-layout directory, and `<run dir>/policy`, a
relative symbolic link (`policies/v<version>`) to the latest, which `load_pretrained`, `python -m gyre.serve
model_dir=<run dir>/policy` and transformers' `from_pretrained` load like the starting checkpoint (docs/runtime.md,
"Outputs").

A version is written in parts, by any number of processes, then finished by one:
1. `stage_policy(run_dir, version)`: a fresh `policies/.v<version>.tmp/`.
2. `write_policy_part(staging, tensors, writer=, index=)`, from any process that sees the path: one safetensors file
   `model-w<writer:03d>-<index:05d>.safetensors` of whole HF-named tensors in their own dtype, written under a
   temporary name, fsynced and renamed (a part under its own name is complete); returns {tensor name: file name}.
3. `finish_policy(staging, weight_map=, config=, dtype=, source_dir=, version=, keep=)`, once every part is written:
   the parts must hold exactly `config`'s tensors (names and shapes), in `dtype`, each once, in the file
   `weight_map` names (a ValueError lists what differs); writes `model.safetensors.index.json`, `config.json`, the
   starting checkpoint's side files (`copy_side_files`) and `policy.json` (`{"version": v, "source": <starting
   checkpoint>}`); fsyncs every file and the directory; renames it `policies/v<version>/` (one rename of a
   complete directory); points `policy` at it (a link made beside it and renamed over it); then removes the versions
   up to this one beyond the newest `keep` (never the one `policy` names), stale staging directories and what the
   earlier layout left. Versions above the finished one are left alone: a resumed run's publications after its
   checkpoint, replaced when the run writes those versions again.
`write_policy(model, ...)` does the three for a whole `DecoderLM` (the native trainer's, the run's end).

Readers: `policy` names one complete version at every instant; a reader that resolves it once (`load_pretrained`
does) reads that version whole. A version is removed `keep - 1` finishes after it stopped being the latest.

What a crash (a SIGKILL, a power loss) leaves:
- while staging, writing parts or finishing before the rename: `policy` -> the previous version, untouched, and a
  `policies/.v<version>.tmp/` (with part files, or a `.partial` one), which the next finish removes;
- between the rename and the link's swap: `policy` -> the previous version, `policies/v<version>/` complete beside
  it, kept or removed by the next finish like any version (a dangling `.policy-v<version>.link`, removed too);
- after the swap: `policy` -> the new version; a version being removed is `policies/.v<k>.old`, removed by the
  next finish.
Two moments, each between two renames (microseconds), leave no `policy`, and a crash there leaves complete
`policies/v<k>/` directories for the next finish to point `policy` at again: the first finish in a run directory of
the earlier layout (a directory cannot be replaced by a link in one rename: `policy/` moves into
`policies/v<its version>/` just before the link takes its place) and a finish of the version `policy` already
names (its directory is replaced by a rename).

The earlier layout: `policy/` a directory, `.policy-<v>.tmp/` (a write cut off), `.policy-previous/` (a swap cut
off). The first finish moves `policy/` into `policies/v<its version>/`, where it counts toward `keep` (removed
instead when that version exists or `policy.json` does not say one), and removes the other two.

A write that fails (a full disk) raises OSError: a part's temporary file is removed, and `write_policy` and
`finish_policy` remove the staging directory (`discard_policy` for a caller whose parts failed); the previous
policy stays in place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.models.decoder_config import DecoderConfig

if TYPE_CHECKING:
    import torch

    from gyre.models.decoder import DecoderLM

__all__ = [
    "POLICIES_DIR",
    "POLICY_DIR",
    "POLICY_META",
    "copy_side_files",
    "discard_policy",
    "finish_policy",
    "stage_policy",
    "write_policy",
    "write_policy_part",
]

POLICY_DIR = "policy"  # the link to the latest version
POLICIES_DIR = "policies"
POLICY_META = "policy.json"
WHOLE_MODEL_PART_BYTES = 1 << 30  # `write_policy`'s parts: a whole model's tensors in files of about this size
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_WEIGHT_INDEX = "model.safetensors.index.json"
_PART = re.compile(r"model-w\d{3,}-\d{5,}\.safetensors")
_VERSION = re.compile(r"v(\d+)")
_SCRAP = re.compile(r"\.v(\d+)\.(tmp|old)")  # a staging directory; a version being removed
_LINK = re.compile(r"\.policy-v(\d+)\.link")  # the link a finish swaps in, before it is renamed `policy`
_EARLIER = re.compile(r"\.policy-(\d+\.tmp|previous)")  # the earlier layout's staging and swapped-out directories


def copy_side_files(source_dir: Path, target: Path) -> None:
    """The source checkpoint's non-weight files; config.json merged: the written one wins, the source adds keys
    (not its `dtype`, transformers 5's name of the `torch_dtype` the written one states)."""
    for path in sorted(source_dir.iterdir()):
        if not path.is_file() or path.name.endswith(_WEIGHT_SUFFIXES) or path.name == _WEIGHT_INDEX:
            continue
        if path.name == "config.json":
            written = json.loads((target / "config.json").read_text())
            source = json.loads(path.read_text())
            if "torch_dtype" in written:
                source.pop("dtype", None)
            merged = {**source, **written}
            (target / "config.json").write_text(json.dumps(merged, indent=2) + "\n")
        elif path.name != POLICY_META:
            shutil.copy2(path, target / path.name)


def stage_policy(run_dir: Path, version: int) -> Path:
    """A fresh, empty `<run_dir>/policies/.v<version>.tmp/` (a stale one of this version removed): where the parts of
    policy `version` are written."""
    if not isinstance(version, int) or version < 0:
        raise ValueError(f"policy version: got {version!r}, expected an integer >= 0")
    root = Path(run_dir) / POLICIES_DIR
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".v{version}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def write_policy_part(staging: Path, tensors: Mapping[str, torch.Tensor], *, writer: int, index: int) -> dict[str, str]:
    """Write `tensors` (HF name -> whole tensor, any device, kept in its dtype) as part `index` of `writer` into
    `staging` (`stage_policy`'s): `model-w<writer:03d>-<index:05d>.safetensors`, fsynced. Any process may call it.
    Returns {tensor name: file name} for `finish_policy`'s weight map. A part already written, or no tensors, is a
    ValueError; a failed write (OSError) leaves no file of it."""
    from gyre.models.hf_weights import save_tensors  # torch: only once a policy is written

    for name, value in (("writer", writer), ("index", index)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"write_policy_part: {name} got {value!r}, expected an integer >= 0")
    if not tensors:
        raise ValueError(f"write_policy_part: writer {writer}'s part {index} has no tensors")
    bad = sorted(repr(name) for name in tensors if not isinstance(name, str) or not name)
    if bad:
        raise ValueError(f"write_policy_part: tensor names must be non-empty strings, got {bad}")
    staging = Path(staging)
    name = f"model-w{writer:03d}-{index:05d}.safetensors"
    final, partial = staging / name, staging / f".{name}.partial"
    if final.exists():
        raise ValueError(f"{final} is already written: writer {writer}'s part {index} twice")
    try:
        save_tensors(tensors, partial)
        _fsync_path(partial)
        partial.rename(final)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return dict.fromkeys(tensors, name)


def discard_policy(staging: Path) -> None:
    """Remove a staging directory whose version will not be finished (a part failed)."""
    shutil.rmtree(staging, ignore_errors=True)


def finish_policy(
    staging: Path,
    *,
    weight_map: Mapping[str, str],
    config: DecoderConfig,
    dtype: torch.dtype,
    source_dir: Path,
    version: int,
    keep: int,
) -> Path:
    """Complete policy `version` from its parts in `staging` and make it `<run dir>/policy` (module docstring):
    `config` is the model's `DecoderConfig`, `dtype` the tensors' torch dtype, `source_dir` the starting checkpoint
    (tokenizer, chat template), `keep` >= 1 the versions kept. Its `policies/v<version>` path. A ValueError (the parts
    do not make the model) or an OSError before the rename removes `staging`; the previous policy stays."""
    from gyre.models.hf_weights import write_config

    staging = Path(staging)
    if staging.name != f".v{version}.tmp" or staging.parent.name != POLICIES_DIR:
        raise ValueError(f"finish_policy: {staging} is not policy {version}'s staging directory (stage_policy)")
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"finish_policy: keep got {keep!r}, expected an integer >= 1")
    root, run_dir = staging.parent, staging.parent.parent
    try:
        total = _checked_parts(staging, weight_map, config, dtype)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (staging / _WEIGHT_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        write_config(config, staging, dtype)
        copy_side_files(Path(source_dir), staging)
        meta = {"version": version, "source": str(Path(source_dir).resolve())}
        (staging / POLICY_META).write_text(json.dumps(meta) + "\n")
        for path in staging.iterdir():
            _fsync_path(path)
        _fsync_path(staging)
    except BaseException:
        discard_policy(staging)
        raise
    target = root / f"v{version}"
    if target.exists():  # this version again (a resumed run): the new one replaces it
        _remove_version(target)
    staging.rename(target)
    _fsync_path(root)
    _point_policy_at(run_dir, version)
    _prune(run_dir, version, keep)
    return target


def write_policy(
    model: DecoderLM, *, source_dir: Path, run_dir: Path, version: int, keep: int = 2, dtype: torch.dtype | None = None
) -> Path:
    """Write `model` (a `DecoderLM`) as policy `version` in `dtype` (None: its parameters' dtype) and make it
    `<run_dir>/policy` (module docstring), keeping `keep` versions; its `policies/v<version>` path."""
    dtype = next(model.parameters()).dtype if dtype is None else dtype
    staging = stage_policy(run_dir, version)
    weight_map: dict[str, str] = {}
    try:
        part, part_bytes = {}, 0
        for name, tensor in model.state_dict().items():
            part[name] = tensor.detach().to(dtype)
            part_bytes += part[name].numel() * part[name].element_size()
            if part_bytes >= WHOLE_MODEL_PART_BYTES:
                weight_map |= write_policy_part(staging, part, writer=0, index=len(set(weight_map.values())))
                part, part_bytes = {}, 0
        if part:
            weight_map |= write_policy_part(staging, part, writer=0, index=len(set(weight_map.values())))
    except BaseException:
        discard_policy(staging)
        raise
    return finish_policy(
        staging,
        weight_map=weight_map,
        config=model.config,
        dtype=dtype,
        source_dir=source_dir,
        version=version,
        keep=keep,
    )


def _checked_parts(staging: Path, weight_map: Mapping[str, str], config: DecoderConfig, dtype: torch.dtype) -> int:
    """The bytes of tensor data of the parts in `staging`, once they hold exactly `config`'s tensors in `dtype`, each
    once, where `weight_map` says; else a ValueError listing every difference."""
    from gyre.models.hf_weights import SAFETENSORS_DTYPES, hf_shapes, tensor_file_specs

    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"finish_policy: dtype got {dtype}, expected one of {list(SAFETENSORS_DTYPES)}")
    expected = hf_shapes(config)
    problems = []
    if set(weight_map) != set(expected):
        problems.append(
            f"the weight map lacks {sorted(set(expected) - set(weight_map))} and has unexpected "
            f"{sorted(set(weight_map) - set(expected))}"
            + (" (tie_word_embeddings: lm_head.weight is the embedding's)" if config.tie_word_embeddings else "")
        )
    unfinished = sorted(p.name for p in staging.iterdir() if p.name.endswith(".partial"))
    if unfinished:
        problems.append(f"parts still being written (or cut off): {unfinished}")
    files = sorted(p.name for p in staging.iterdir() if _PART.fullmatch(p.name))
    named = set(weight_map.values())
    if named - set(files):
        problems.append(f"the weight map names files that are not in {staging}: {sorted(named - set(files))}")
    found: dict[str, str] = {}
    total = 0
    for file in files:
        for name, (file_dtype, shape, size) in tensor_file_specs(staging / file).items():
            total += size
            if name in found:
                problems.append(f"{name} is in two parts: {found[name]} and {file}")
                continue
            found[name] = file
            if weight_map.get(name) != file:
                problems.append(f"{name} is in {file}, the weight map says {weight_map.get(name)}")
            if file_dtype != SAFETENSORS_DTYPES[dtype]:
                problems.append(f"{name} is {file_dtype}, expected {SAFETENSORS_DTYPES[dtype]} ({dtype})")
            if name in expected and shape != expected[name]:
                problems.append(f"{name} has shape {shape}, the config's is {expected[name]}")
    absent = sorted(name for name, file in weight_map.items() if file in files and name not in found)
    if absent:
        problems.append(f"tensors the weight map places in files that lack them: {absent}")
    if problems:
        raise ValueError(f"policy {staging.name}: the parts do not make the model: " + "; ".join(problems))
    return total


def _fsync_path(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _linked_version(run_dir: Path) -> int | None:
    """The version `<run_dir>/policy` links to; None when it is no link of this layout."""
    try:
        match = _VERSION.fullmatch(Path(os.readlink(run_dir / POLICY_DIR)).name)
    except OSError:  # absent, or the earlier layout's directory
        return None
    return int(match.group(1)) if match else None


def _point_policy_at(run_dir: Path, version: int) -> None:
    """Make `<run_dir>/policy` the link `policies/v<version>`: a link made beside it and renamed over it. `policy/`
    of the earlier layout moves into `policies/` first (module docstring)."""
    link = run_dir / f".policy-v{version}.link"
    link.unlink(missing_ok=True)
    os.symlink(f"{POLICIES_DIR}/v{version}", link)
    current = run_dir / POLICY_DIR
    if current.is_dir() and not current.is_symlink():
        _retire_earlier_policy(current, run_dir)
    os.replace(link, current)
    _fsync_path(run_dir)


def _retire_earlier_policy(directory: Path, run_dir: Path) -> None:
    """The earlier layout's `policy/` moved to `policies/v<its version>/`, or to `.policy-previous/` (removed by the
    prune) when that version exists or its `policy.json` does not say one."""
    try:
        version = json.loads((directory / POLICY_META).read_text())["version"]
    except (OSError, ValueError, KeyError, TypeError):
        version = None
    target = run_dir / POLICIES_DIR / f"v{version}"
    if not isinstance(version, int) or version < 0 or target.exists():
        target = run_dir / ".policy-previous"
        shutil.rmtree(target, ignore_errors=True)
    directory.rename(target)


def _remove_version(path: Path) -> None:
    """`policies/v<k>` renamed `.v<k>.old` (never a half-removed `v<k>`), then removed."""
    scrap = path.with_name(f".{path.name}.old")
    shutil.rmtree(scrap, ignore_errors=True)
    path.rename(scrap)
    shutil.rmtree(scrap, ignore_errors=True)


def _prune(run_dir: Path, version: int, keep: int) -> None:
    """Remove the versions up to `version` beyond the newest `keep` (never the one `policy` links to), staging
    directories of versions up to it, versions half removed, stale links and the earlier layout's leftovers."""
    root = run_dir / POLICIES_DIR
    linked = _linked_version(run_dir)
    versions = sorted(
        (int(m.group(1)) for p in root.iterdir() if (m := _VERSION.fullmatch(p.name)) and p.is_dir()), reverse=True
    )
    for old in [v for v in versions if v <= version][keep:]:
        if old != linked:
            _remove_version(root / f"v{old}")
    for path in root.iterdir():
        if (m := _SCRAP.fullmatch(path.name)) and (m.group(2) == "old" or int(m.group(1)) <= version):
            shutil.rmtree(path, ignore_errors=True)  # a higher version's staging may be in progress
    for path in run_dir.iterdir():
        if (m := _LINK.fullmatch(path.name)) and int(m.group(1)) <= version:
            path.unlink(missing_ok=True)
        elif _EARLIER.fullmatch(path.name):
            shutil.rmtree(path, ignore_errors=True)
