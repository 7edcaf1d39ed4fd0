"""`python -m gyre.serve` refuses what a user can fix with one line on stderr and exit status 2."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest


def serve(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gyre.serve", f"hydra.run.dir={tmp_path / 'run'}", *overrides]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["proxy.port=70000"], "proxy.port=70000 is not allowed"),
        (["+surprise=1"], "surprise=1 is not allowed"),
        (["engine.dtype=int8"], "engine.dtype='int8' is not allowed"),
        (["engine.enabled=false"], "engine.enabled=False is not allowed"),
        (["proxy.sampling.top_p=0"], "sampling.top_p=0"),
        (["model_dir=/no/such/model"], "config.json not found"),
    ],
)
def test_a_bad_config_exits_2_with_one_line(tmp_path, overrides, message):
    done = serve(tmp_path, *overrides)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gyre.serve: config error: ") and message in lines[0]


def test_a_taken_port_exits_2_with_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = serve(tmp_path, f"proxy.port={port}", "duration_s=1")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("gyre.serve: config error: ")
    assert str(port) in done.stderr
