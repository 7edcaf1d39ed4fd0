"""`exec_wrapper` (gyre/harness/sandbox.py): the argv prefix that sets a harness's rlimits and own uid with
util-linux's prlimit and setpriv, so that the controller starts the harness without a `preexec_fn`."""

from __future__ import annotations

import resource
import shutil

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
        "--",
    ]
    assert exec_wrapper(limits, None) == argv[:4]  # no uid to drop to: prlimit alone


def test_nothing_to_set_is_no_prefix():
    assert exec_wrapper([], None) == []


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
    assert exec_wrapper([], None) == []
