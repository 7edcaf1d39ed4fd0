"""`exec_wrapper` (gyre/harness/sandbox.py): the argv prefix that sets a harness's rlimits and own uid with
util-linux's prlimit and setpriv, so that the controller starts the harness without a `preexec_fn`; and SIGTERM as
the harness's parent-death signal (it is stopped when its controller dies)."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre.harness import sandbox
from gyre.harness.sandbox import exec_wrapper

needs_util_linux = pytest.mark.skipif(
    shutil.which("prlimit") is None or shutil.which("setpriv") is None, reason="prlimit/setpriv not installed"
)


@needs_util_linux
def test_the_limits_then_the_uid_then_the_harness():
    limits = [(resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CPU, 30)]
    argv = exec_wrapper(limits, 40_001)
    assert argv == [
        shutil.which("prlimit"),
        "--nofile=64:64",
        "--cpu=30:30",
        "--",
        shutil.which("setpriv"),
        "--reuid=40001",
        "--regid=40001",
        "--clear-groups",
        "--pdeathsig=TERM",  # after the uid: a uid change clears it
        "--",
    ]
    assert exec_wrapper(limits, None) == [*argv[:5], "--pdeathsig=TERM", "--"]  # no uid to drop to


@needs_util_linux
def test_with_nothing_else_to_set_the_harness_still_dies_with_its_parent():
    assert exec_wrapper([], None) == [shutil.which("setpriv"), "--pdeathsig=TERM", "--"]


def test_a_limit_above_the_hard_one_is_capped_to_it():
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    argv = exec_wrapper([(resource.RLIMIT_NOFILE, hard + 1000)], None)
    if argv is None:
        pytest.skip("prlimit not installed")
    assert f"--nofile={hard}:{hard}" in argv


def test_a_missing_tool_means_the_preexec_fallback(monkeypatch):
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    assert exec_wrapper([(resource.RLIMIT_NOFILE, 64)], None) is None
    assert exec_wrapper([], 40_001) is None
    assert exec_wrapper([], None) == []  # no setpriv and nothing else to set: no preexec for the death signal alone


@pytest.mark.parametrize("path", ["exec-wrapper", "preexec"])
def test_a_harness_dies_with_the_process_that_started_it(tmp_path, monkeypatch, path):
    """A controller SIGKILLed mid-run left its harnesses running (seen in the resume test). A stand-in controller
    starts a harness through the sandbox, then is SIGKILLed: the harness goes with it, on both start paths."""
    token = f"{os.getpid()}.{time.monotonic_ns()}"
    controller = f"""
import asyncio, sys
from pathlib import Path
from gyre.harness import sandbox as module
if {path == "preexec"!r}:
    module.exec_wrapper = lambda limits, uid: None
from gyre.harness.protocol import ExecutionContext, LaunchSpec
box = module.LocalSandbox(root=Path({str(tmp_path)!r}), isolate_user=False)
dirs = box.prepare("e")
context = ExecutionContext(execution_id="e", task_prompt="", workspace=dirs.workspace, home=dirs.home,
    log_dir=dirs.log_dir, anthropic_base_url="", openai_base_url="", api_key="", model="")
async def main():
    process = await box.start(LaunchSpec(argv=("sleep", {token!r}), env={{}}), context, stdout=1, stderr=2)
    print(process.pid, flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""
    parent = subprocess.Popen([sys.executable, "-c", controller], stdout=subprocess.PIPE, text=True)
    try:
        harness = int(parent.stdout.readline())
        assert token.encode() in Path(f"/proc/{harness}/cmdline").read_bytes()
        # Kill only once the harness runs `sleep`: until then the pid may still be setpriv (or the preexec child)
        # before it has set the death signal, and a parent that dies first is a parent it never knew.
        deadline = time.monotonic() + 10
        while Path(f"/proc/{harness}/comm").read_text().strip() != "sleep" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert Path(f"/proc/{harness}/comm").read_text().strip() == "sleep"
    finally:
        parent.kill()
        parent.wait(timeout=10)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{harness}"):
        time.sleep(0.05)
    if os.path.exists(f"/proc/{harness}"):
        os.kill(harness, signal.SIGKILL)
        raise AssertionError("the harness outlived its controller")
