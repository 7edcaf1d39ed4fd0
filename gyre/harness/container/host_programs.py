"""Run a program installed on the host inside a task's container image, on the host's own libraries.

An agent CLI (Claude Code's native `claude.exe`, Codex's launcher under node, a pyenv Python) is installed on the
controller, but its execution runs in the task's image, which may have no node at all or another libc. The host's
`/usr` is bound read-only at `HOST_ROOT/usr` (never over the image's `/usr`), and the program is started through
the host's dynamic loader with the host's library directories: the program links the host's libc and libraries,
while every child it spawns (`/bin/bash -c ...`, `python3`) is an ordinary exec resolved in the image, on the
image's loader and libraries. `--library-path` is an argument of the loader, not `LD_LIBRARY_PATH`, so no child
inherits it; `--inhibit-cache` keeps the image's `/etc/ld.so.cache` (which names the image's libraries) out of it.
Like LD_LIBRARY_PATH, `--library-path` is searched before a binary's DT_RUNPATH, so the binary's own RUNPATH goes
first in it: pyenv's python would otherwise load the host's Debian libpython3.11 instead of its own (seen).

What the caller provides: the binds of `host_mounts()`, and every host path outside `/usr` that a program needs
(the npm cache, the pyenv prefix) bound read-only at the same path. Assumes an x86-64 glibc host with merged /usr
(Debian 12).

The limit: a program started through the loader sees the loader as `/proc/self/exe` (node's and Bun's
`process.execPath`), so one that re-executes itself does not work. Claude Code 2.1.197 (a Bun binary) does: its
embedded ripgrep and the `grep`/`find` shell functions of its Bash tool run `process.execPath` under another argv0,
and fail (seen). In a glibc image, run claude.exe (which needs only libc/libm/librt/libdl/libpthread, GLIBC_2.17)
as it is, on the image's loader; `USE_BUILTIN_RIPGREP=0` with a static rg on PATH mends the Grep tool only.
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "HOST_LIB_DIRS",
    "HOST_LOADER",
    "HOST_ROOT",
    "ElfInfo",
    "container_path",
    "host_argv",
    "host_mounts",
    "is_elf",
    "parse_elf",
    "parse_shebang",
    "read_elf",
]

HOST_ROOT = "/run/gyre/host"  # the host's /usr is at HOST_ROOT/usr in a container
HOST_LOADER = "/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"  # the real file (/lib64/... is a link to it)
HOST_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib")  # the host's default search path (merged /usr)
_MERGED = ("/bin", "/sbin", "/lib", "/lib64")  # links into /usr on a merged-/usr host
_MAX_SHEBANG_DEPTH = 4  # as Linux's binfmt_script recursion limit
_PT_LOAD, _PT_DYNAMIC, _PT_INTERP = 1, 2, 3
_DT_STRTAB, _DT_RPATH, _DT_RUNPATH = 5, 15, 29


def host_mounts() -> list[tuple[str, str]]:
    """The read-only binds (host path, container path) every host program needs: the host's /usr.

    /usr holds the loader, the libraries and the interpreters (node, a system python); on a merged-/usr host
    /bin, /lib and /lib64 are links into it, so nothing else of the host is needed. /etc stays the image's.
    """
    return [("/usr", HOST_ROOT + "/usr")]


def container_path(host_path: str) -> str:
    """Where an absolute host path is in a container: /usr (and the merged /bin, /lib...) under HOST_ROOT; else
    unchanged (the caller binds it at the same path)."""
    for top in _MERGED:
        if host_path == top or host_path.startswith(top + "/"):
            host_path = "/usr" + host_path
            break
    if host_path == "/usr" or host_path.startswith("/usr/"):
        return HOST_ROOT + host_path
    return host_path


def parse_shebang(head: bytes) -> list[str] | None:
    """A script's `#!` line as Linux reads it: [interpreter] or [interpreter, the rest of the line as ONE argument];
    None when `head` (the file's first bytes) is no `#!` line."""
    if not head.startswith(b"#!"):
        return None
    line = head[2:].split(b"\n", 1)[0].decode("utf-8", "surrogateescape").strip(" \t\r")
    if not line:
        return None
    interpreter, _, rest = line.replace("\t", " ").partition(" ")
    rest = rest.strip(" ")
    return [interpreter, rest] if rest else [interpreter]


def _env_command(args: Sequence[str], path: str) -> list[str]:
    """`env [-S] NAME ARGS...` resolved as env would on the host: NAME found on `path`."""
    words = [w for a in args for w in shlex.split(a)] if args else []  # covers `env -S a b` and `env a`
    words = [w for w in words if w not in ("-S", "--split-string")]
    if words and "=" in words[0]:  # env's NAME=VALUE assignments are not supported: say so, don't guess
        raise ValueError(f"`#!/usr/bin/env` with assignments is not supported: {args!r}")
    if not words or words[0].startswith("-"):
        raise ValueError(f"`#!/usr/bin/env` line not understood: {args!r}")
    found = shutil.which(words[0], path=path)
    if found is None:
        raise FileNotFoundError(f"`{words[0]}` (a script's `#!/usr/bin/env`) is not on PATH {path!r}")
    return [found, *words[1:]]


def is_elf(head: bytes) -> bool:
    return head[:4] == b"\x7fELF"


@dataclass(frozen=True)
class ElfInfo:
    """What host_argv needs of an ELF file: its loader (None: static or static-pie, the musl-static Codex and its
    bundled rg, run as they are) and its DT_RUNPATH (or DT_RPATH) entries, `$ORIGIN` left as written."""

    interpreter: str | None
    runpath: tuple[str, ...]


def parse_elf(read_at: Callable[[int, int], bytes]) -> ElfInfo:
    """Parse a 64-bit little-endian ELF file through `read_at(offset, size)`: a 245 MB claude.exe is never read
    whole, a test passes a slice of crafted bytes."""
    head = read_at(0, 64)
    if not is_elf(head) or head[4] != 2 or head[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    phoff, phentsize, phnum = _u(head, 32, 8), _u(head, 54, 2), _u(head, 56, 2)
    table = read_at(phoff, phentsize * phnum)
    interpreter, dynamic, loads = None, None, []
    for i in range(phnum):
        ph = table[i * phentsize : (i + 1) * phentsize]
        if len(ph) < 56:
            raise ValueError("truncated ELF program header table")
        kind, offset, vaddr, filesz = _u(ph, 0, 4), _u(ph, 8, 8), _u(ph, 16, 8), _u(ph, 32, 8)
        if kind == _PT_INTERP:
            interpreter = read_at(offset, filesz).split(b"\0", 1)[0].decode()
        elif kind == _PT_DYNAMIC:
            dynamic = read_at(offset, filesz)
        elif kind == _PT_LOAD:
            loads.append((vaddr, filesz, offset))
    if dynamic is None:
        return ElfInfo(interpreter, ())
    tags: dict[int, int] = {}
    for i in range(0, len(dynamic) - 15, 16):
        tag = _u(dynamic, i, 8)
        if tag == 0:  # DT_NULL
            break
        tags.setdefault(tag, _u(dynamic, i + 8, 8))
    name = tags.get(_DT_RUNPATH, tags.get(_DT_RPATH))
    if name is None or _DT_STRTAB not in tags:
        return ElfInfo(interpreter, ())
    address = tags[_DT_STRTAB] + name
    for vaddr, filesz, offset in loads:
        if vaddr <= address < vaddr + filesz:
            text = read_at(address - vaddr + offset, 4096).split(b"\0", 1)[0].decode()
            return ElfInfo(interpreter, tuple(d for d in text.split(":") if d))
    raise ValueError("ELF DT_STRTAB outside every PT_LOAD segment")


def read_elf(path: str) -> ElfInfo:
    with open(path, "rb") as f:

        def read_at(offset: int, size: int) -> bytes:
            f.seek(offset)
            return f.read(size)

        return parse_elf(read_at)


def _u(data: bytes, offset: int, size: int) -> int:
    return int.from_bytes(data[offset : offset + size], "little")


def _read_head(path: str, size: int = 256) -> bytes:
    with open(path, "rb") as f:
        return f.read(size)


def host_argv(argv: Sequence[str], path: str) -> list[str]:
    """An argv that runs the host program `argv[0]` (an absolute host path: an ELF binary or a `#!` script) in a
    container with `host_mounts()` bound, on the host's loader and libraries.

    `path` is the host PATH that a `#!/usr/bin/env NAME` line is resolved against. Scripts are unwrapped to their
    ELF interpreter (as the kernel would), the ELF file is its host real path (an `/etc/alternatives` link would
    point into the image's /etc), `--argv0` keeps the name it was called by (a venv's python finds its pyvenv.cfg
    by it), and paths under /usr become HOST_ROOT/usr/... A static ELF (no PT_INTERP) is run without the loader.
    """
    if not argv or not os.path.isabs(argv[0]):
        raise ValueError(f"host_argv needs an absolute host path as argv[0], got {argv[:1]!r}")
    command = list(argv)
    for _ in range(_MAX_SHEBANG_DEPTH + 1):
        head = _read_head(command[0])
        shebang = parse_shebang(head)
        if shebang is None:
            break
        interpreter, script = shebang[0], container_path(command[0])
        if os.path.basename(interpreter) == "env":
            command = [*_env_command(shebang[1:], path), script, *command[1:]]
        else:
            command = [*shebang, script, *command[1:]]
    else:
        raise ValueError(f"{argv[0]}: more than {_MAX_SHEBANG_DEPTH} levels of `#!` interpreters")
    if not is_elf(head):
        raise ValueError(f"{command[0]} is neither an ELF binary nor a `#!` script")
    real = os.path.realpath(command[0])
    elf = read_elf(real)
    if elf.interpreter is None:
        return [container_path(real), *command[1:]]
    origin = os.path.dirname(real)
    runpath = [d.replace("${ORIGIN}", origin).replace("$ORIGIN", origin) for d in elf.runpath]
    return [
        container_path(HOST_LOADER),
        "--inhibit-cache",
        "--library-path",
        ":".join(container_path(d) for d in [*runpath, *HOST_LIB_DIRS]),
        "--argv0",
        container_path(command[0]),
        container_path(real),
        *command[1:],
    ]
