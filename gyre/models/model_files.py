"""The files of an HF-layout model directory and where gyre caches what it builds: shared by the model builds.

`tiny`, `moe`, `families`, `qwen_vocab` and `llama3` import this module and none of it imports them, so the builds
import one another in one direction only. Stdlib only.
- `CONFIG_FILE`, `WEIGHTS_FILE`, `GENERATION_CONFIG_FILE`, `TOKENIZER_FILES`: the names a build writes.
- `prepare_out_dir(out, files, build=...)`: `out` created if absent; a ValueError if it holds anything but `files`
  (a build never deletes a user's checkpoint).
- `default_cache_root()`: `$GYRE_CACHE` if set, else `~/.cache/gyre` (the tiny model, vocabularies, warm starts).
- `package_version(name)`: an installed distribution's version, `"absent"` if none (cache keys).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

CONFIG_FILE, WEIGHTS_FILE, GENERATION_CONFIG_FILE = "config.json", "model.safetensors", "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CACHE_ENV = "GYRE_CACHE"  # overrides the default cache root ~/.cache/gyre


def prepare_out_dir(out: Path, files: Sequence[str], *, build: str = "a model build") -> Path:
    """`out`, created if absent; a ValueError if it is a file or holds anything but `files` (what `build` writes:
    a build never deletes a user's checkpoint)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {out} exists and is not a directory")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in files)
        if foreign:
            raise ValueError(
                f"out_dir {out} holds files {build} does not write ({', '.join(foreign[:5])}"
                f"{', ...' if len(foreign) > 5 else ''}); use an empty or new directory"
            )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"out_dir {out} cannot be created: {err.strerror or err}") from err
    return out


def default_cache_root() -> Path:
    """`$GYRE_CACHE` if set, else `~/.cache/gyre`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gyre"


def package_version(package: str) -> str:
    """The installed version of distribution `package`, or "absent"."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"
