"""Host-installed programs run in a minimal image (no node) through host_programs.host_argv, under podman.

Skips unless `podman` is on PATH and the image ($GYRE_TEST_HOST_PROGRAMS_IMAGE, default localhost/gyre-exp-base:1:
a Debian bookworm mmdebstrap with python3, no nodejs) exists; each CLI test skips when its npm install
(tests/integration/test_harness_clis.py makes it) is missing. Some hosts need CONTAINERS_CONF exported for podman
(a runtime or ulimits setting): the test passes the environment through. Containers: `hp-<random>`, label
gyre.test=hostprog, --network none, --rm.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from gyre.harness.container.host_programs import host_argv, host_mounts
from gyre.harness.runners.claude_code import CLAUDE_CODE_PACKAGE, CLAUDE_CODE_VERSION, npm_cache_executable
from gyre.harness.runners.codex import CODEX_PACKAGE, CODEX_VERSION

IMAGE = os.environ.get("GYRE_TEST_HOST_PROGRAMS_IMAGE", "localhost/gyre-exp-base:1")
HOST_PATH = "/usr/local/bin:/usr/bin:/bin"


def _image_missing() -> str | None:
    if shutil.which("podman") is None:
        return "podman is not on PATH"
    found = subprocess.run(["podman", "image", "exists", IMAGE], capture_output=True, timeout=60)
    return None if found.returncode == 0 else f"image {IMAGE} does not exist (podman image exists: {found.returncode})"


pytestmark = [pytest.mark.slow]
_MISSING = _image_missing() if os.environ.get("GYRE_SKIP_CONTAINER_TESTS") != "1" else "GYRE_SKIP_CONTAINER_TESTS=1"


@pytest.fixture(autouse=True)
def _needs_image() -> None:
    if _MISSING:
        pytest.skip(_MISSING)


def run_in_image(argv: list[str], binds: list[str]) -> subprocess.CompletedProcess[str]:
    """`argv` in the image, the host's /usr at HOST_ROOT/usr and each of `binds` read-only at its own path."""
    command = ["podman", "run", "--rm", "--name", f"hp-{uuid.uuid4().hex[:12]}", "--label", "gyre.test=hostprog"]
    command += ["--network", "none"]
    for host, container in [*host_mounts(), *((b, b) for b in binds)]:
        command += ["-v", f"{host}:{container}:ro"]
    return subprocess.run([*command, IMAGE, *argv], capture_output=True, text=True, timeout=120)


def npm_install(package: str, version: str, bin_name: str) -> Path:
    launcher = npm_cache_executable(package, version, bin_name)
    if not launcher.exists():
        pytest.skip(f"{package}@{version} is not installed at {launcher}")
    return launcher


def test_image_has_no_node() -> None:
    """The premise: the image cannot run the CLIs on its own."""
    assert run_in_image(["sh", "-c", "command -v node || echo none"], []).stdout.strip() == "none"


def test_claude_version() -> None:
    claude = npm_install(CLAUDE_CODE_PACKAGE, CLAUDE_CODE_VERSION, "claude")
    done = run_in_image(host_argv([str(claude), "--version"], HOST_PATH), [str(claude.parents[2])])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{CLAUDE_CODE_VERSION} (Claude Code)"


def test_codex_version_through_the_node_launcher() -> None:
    """bin/codex.js under the host's node (a `#!/usr/bin/env node` script), which execs the static native binary."""
    codex = npm_install(CODEX_PACKAGE, CODEX_VERSION, "codex")
    if shutil.which("node", path=HOST_PATH) is None:
        pytest.skip(f"no node on the host's {HOST_PATH}")
    done = run_in_image(host_argv([str(codex), "--version"], HOST_PATH), [str(codex.parents[2])])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"codex-cli {CODEX_VERSION}"


def test_codex_native_binary_without_node() -> None:
    codex = npm_install(CODEX_PACKAGE, CODEX_VERSION, "codex")
    native = codex.parents[1] / "@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
    if not native.exists():
        pytest.skip(f"no native Codex binary at {native}")
    argv = host_argv([str(native), "--version"], HOST_PATH)
    assert argv[0] == str(native)  # static: no loader
    done = run_in_image(argv, [str(codex.parents[2])])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"codex-cli {CODEX_VERSION}"


def test_host_python_on_host_libraries_its_children_on_the_image() -> None:
    """The test's own (base) Python imports its C extensions against the host's libssl/libsqlite; the python3 it
    spawns is the image's, on the image's libc."""
    if sys.base_prefix.startswith("/usr"):
        pytest.skip("the base Python is the system's own under /usr; this test is for a separately installed one")
    python = os.path.realpath(
        os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    )
    probe = (
        "import ssl, sqlite3, json, subprocess, sys; "
        'child = \'import sys; maps = open("/proc/self/maps").read(); '
        'print(sys.version.split()[0], maps.count("/run/gyre/host"))\'; '
        "print(sys.version.split()[0], subprocess.check_output(['python3', '-c', child], text=True).strip())"
    )
    done = run_in_image(host_argv([python, "-c", probe], HOST_PATH), [sys.base_prefix])
    assert done.returncode == 0, done.stderr
    ours, child, child_host_maps = done.stdout.split()
    assert ours == sys.version.split()[0]
    assert child_host_maps == "0", f"the image's python3 {child} mapped host files"
