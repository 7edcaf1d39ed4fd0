"""host_programs' pure parts: `#!` lines, host-to-container paths, ELF loader / RUNPATH detection, host_argv."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from gyre.harness.container.host_programs import (
    HOST_LOADER,
    HOST_ROOT,
    container_path,
    host_argv,
    parse_elf,
    parse_shebang,
    read_elf,
)

LIB_DIRS = f"{HOST_ROOT}/usr/lib/x86_64-linux-gnu:{HOST_ROOT}/usr/lib"


def crafted_elf(interpreter: str | None = None, runpath: str | None = None) -> bytes:
    """A minimal ELF64 LE file: one PT_LOAD over the whole file (vaddr == offset), PT_INTERP if `interpreter`,
    PT_DYNAMIC with DT_STRTAB / DT_RUNPATH / DT_NULL if `runpath`. Only the headers parse_elf reads are real."""
    kinds = [1] + ([3] if interpreter else []) + ([2] if runpath else [])
    data_at = 64 + 56 * len(kinds)
    interp = (interpreter or "").encode() + b"\0" if interpreter else b""
    strtab = b"\0" + runpath.encode() + b"\0" if runpath else b""
    strtab_at = data_at + len(interp)
    dynamic = struct.pack("<qQqQqQ", 5, strtab_at, 29, 1, 0, 0) if runpath else b""
    dynamic_at = strtab_at + len(strtab)
    total = dynamic_at + len(dynamic)
    segments = {1: (0, total), 3: (data_at, len(interp)), 2: (dynamic_at, len(dynamic))}
    header = (
        b"\x7fELF"
        + bytes([2, 1, 1])
        + bytes(9)
        + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 64, 0, 0, 64, 56, len(kinds), 64, 0, 0)
    )
    table = b"".join(
        struct.pack("<IIQQQQQQ", k, 4, segments[k][0], segments[k][0], 0, segments[k][1], segments[k][1], 8)
        for k in kinds
    )
    return header + table + interp + strtab + dynamic


def read_at(data: bytes):
    return lambda offset, size: data[offset : offset + size]


def executable(path: Path, content: bytes) -> str:
    path.write_bytes(content)
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"#!/usr/bin/env node\n// js", ["/usr/bin/env", "node"]),
        (b"#! /bin/sh -e -x\r\necho", ["/bin/sh", "-e -x"]),  # the rest of the line is ONE argument, as Linux does
        (b"#!/usr/bin/python3\n", ["/usr/bin/python3"]),
        (b"#!/bin/bash", ["/bin/bash"]),
        (b"#!\n", None),
        (b"\x7fELF\x02\x01", None),
        (b"echo hi\n", None),
    ],
)
def test_parse_shebang(head: bytes, expected: list[str] | None) -> None:
    assert parse_shebang(head) == expected


@pytest.mark.parametrize(
    ("host", "container"),
    [
        ("/usr/bin/node", f"{HOST_ROOT}/usr/bin/node"),
        ("/usr", f"{HOST_ROOT}/usr"),
        ("/bin/sh", f"{HOST_ROOT}/usr/bin/sh"),  # merged /usr: /bin is /usr/bin
        ("/lib64/ld-linux-x86-64.so.2", f"{HOST_ROOT}/usr/lib64/ld-linux-x86-64.so.2"),
        ("/usrlocal/x", "/usrlocal/x"),
        ("/root/.pyenv/versions/3.11.7/bin/python3", "/root/.pyenv/versions/3.11.7/bin/python3"),
    ],
)
def test_container_path(host: str, container: str) -> None:
    assert container_path(host) == container


def test_parse_elf_crafted() -> None:
    assert parse_elf(read_at(crafted_elf())).interpreter is None
    dynamic = parse_elf(read_at(crafted_elf("/lib64/ld-linux-x86-64.so.2", "$ORIGIN/../lib:/opt/x")))
    assert dynamic.interpreter == "/lib64/ld-linux-x86-64.so.2"
    assert dynamic.runpath == ("$ORIGIN/../lib", "/opt/x")
    with pytest.raises(ValueError, match="not a 64-bit"):
        parse_elf(read_at(b"#!/bin/sh\n" + bytes(64)))


def test_real_static_binary_needs_no_loader() -> None:
    """Debian's ldconfig is static-pie (PT_DYNAMIC but no PT_INTERP), like the musl-static Codex binary."""
    ldconfig = "/usr/sbin/ldconfig"
    if not os.path.isfile(ldconfig) or read_elf(ldconfig).interpreter is not None:
        pytest.skip(f"{ldconfig} is not a static binary on this host")
    assert host_argv([ldconfig, "-p"], "/usr/bin") == [f"{HOST_ROOT}{ldconfig}", "-p"]


def test_static_elf_runs_as_is(tmp_path: Path) -> None:
    binary = executable(tmp_path / "codex", crafted_elf())
    assert host_argv([binary, "--version"], "") == [binary, "--version"]


def test_dynamic_elf_through_the_host_loader_with_its_runpath_first(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    real = executable(tmp_path / "bin" / "python3.11", crafted_elf("/lib64/ld-linux-x86-64.so.2", "$ORIGIN/../lib"))
    (tmp_path / "bin" / "python3").symlink_to("python3.11")
    argv = host_argv([str(tmp_path / "bin" / "python3"), "-c", "pass"], "")
    assert argv == [
        f"{HOST_ROOT}{HOST_LOADER}",
        "--inhibit-cache",
        "--library-path",
        f"{tmp_path}/bin/../lib:{LIB_DIRS}",  # before the host's: --library-path outranks DT_RUNPATH
        "--argv0",
        str(tmp_path / "bin" / "python3"),  # the name it was called by (a venv finds pyvenv.cfg by it)
        real,
        "-c",
        "pass",
    ]


def test_env_shebang_resolved_on_the_given_path(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    node = executable(tmp_path / "bin" / "node", crafted_elf("/lib64/ld-linux-x86-64.so.2"))
    script = executable(tmp_path / "codex.js", b"#!/usr/bin/env node\nconsole.log(1)\n")
    argv = host_argv([script, "--version"], f"/nonexistent:{tmp_path / 'bin'}")
    assert argv == [
        f"{HOST_ROOT}{HOST_LOADER}",
        "--inhibit-cache",
        "--library-path",
        LIB_DIRS,
        "--argv0",
        node,
        node,
        script,
        "--version",
    ]


def test_env_split_string_and_nested_script(tmp_path: Path) -> None:
    static = executable(tmp_path / "interp", crafted_elf())
    wrapper = executable(tmp_path / "wrapper", f"#!{static} -q\n".encode())
    script = executable(tmp_path / "tool", b"#!/usr/bin/env -S wrapper --flag\n")
    assert host_argv([script, "x"], str(tmp_path)) == [static, "-q", wrapper, "--flag", script, "x"]


def test_script_under_usr_is_rewritten(tmp_path: Path) -> None:
    """A `#!/bin/sh` script: the interpreter is the host's real /bin/sh file under HOST_ROOT, called as /bin/sh."""
    sh = os.path.realpath("/bin/sh")
    if not os.path.isfile(sh) or read_elf(sh).interpreter is None:
        pytest.skip("/bin/sh is not a dynamically linked ELF binary on this host")
    script = executable(tmp_path / "run.sh", b"#!/bin/sh\necho hi\n")
    argv = host_argv([script], "/usr/bin")
    assert argv[4:] == ["--argv0", f"{HOST_ROOT}/usr/bin/sh", container_path(sh), script]


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="absolute"):
        host_argv(["node"], "/usr/bin")
    text = executable(tmp_path / "notes", b"plain text\n")
    with pytest.raises(ValueError, match="neither an ELF"):
        host_argv([text], "/usr/bin")
    assignment = executable(tmp_path / "a", b"#!/usr/bin/env A=1 node\n")
    with pytest.raises(ValueError, match="assignments"):
        host_argv([assignment], "/usr/bin")
    missing = executable(tmp_path / "m", b"#!/usr/bin/env no-such-interpreter-gyre\n")
    with pytest.raises(FileNotFoundError, match="no-such-interpreter-gyre"):
        host_argv([missing], str(tmp_path))
    loop = tmp_path / "loop"
    executable(loop, f"#!{loop}\n".encode())
    with pytest.raises(ValueError, match="levels"):
        host_argv([str(loop)], "")
