"""Pure packages import no torch, no distributed code, no HTTP stack and no hydra (STYLE.md)."""

import subprocess
import sys

import pytest

FORBIDDEN = ("torch", "aiohttp", "megatron", "sglang", "hydra", "omegaconf", "numpy", "requests", "httpx")


@pytest.mark.parametrize("package", ["gyre.sched", "gyre.config"])
def test_pure_package_imports_nothing_heavy(package):
    code = (
        "import sys\n"
        f"import {package}\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""
