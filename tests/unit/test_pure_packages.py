"""Pure packages import no distributed code, no HTTP stack, no hydra and only their allowed heavy deps (STYLE.md).

Each package is imported alone in a fresh interpreter (with a timeout), so another test's imports cannot
hide a dependency. `torch` itself imports `torch.distributed`, so for the packages allowed torch the check
is that importing the package loads no `torch.distributed` module beyond what `import torch` loads, plus a
source scan for `torch.distributed` in their code.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = (
    "torch",
    "numpy",
    "aiohttp",
    "httpx",
    "requests",
    "megatron",
    "sglang",
    "mooncake",
    "hydra",
    "omegaconf",
    "wandb",
)
# Allowed heavy top-level packages per pure package; everything else in HEAVY is forbidden.
ALLOWED = {
    "gyre.sched": (),  # stdlib, and gyre.config (itself stdlib) for spec_from_config
    "gyre.config": ("omegaconf",),  # stdlib, and omegaconf in hydra_errors (docs/architecture.md, import rules)
    "gyre.traj": ("numpy",),
    "gyre.rl": ("numpy", "torch"),  # no torch.distributed, checked below
    "gyre.data": ("numpy", "torch"),
}
# gyre packages each pure package may load (dependencies point one way: docs/architecture.md).
ALLOWED_GYRE = {
    "gyre.sched": {"sched", "config"},
    "gyre.config": {"config"},
    "gyre.traj": {"traj", "config"},
    "gyre.rl": {"rl", "config"},
    "gyre.data": {"data", "traj", "rl", "config"},
}
IMPORT_TIMEOUT_S = 120

PROBE = """
import json, sys
baseline = set(sys.modules)
if {preload!r}:
    import torch  # what torch loads by itself (torch.distributed included) is not the package's doing
    baseline = set(sys.modules)
import importlib, pkgutil
import {package}
for module in pkgutil.walk_packages({package}.__path__, "{package}."):  # every module, not only __init__
    if not module.name.endswith("__main__"):
        importlib.import_module(module.name)
loaded = set(sys.modules)
print(json.dumps({{
    "top": sorted({{m.split(".")[0] for m in loaded}}),
    "new_distributed": sorted(m for m in loaded - baseline if m.split(".")[:2] == ["torch", "distributed"]),
    "gyre": sorted({{m.split(".")[1] for m in loaded if m.startswith("gyre.")}}),
}}))
"""


def import_alone(package: str) -> dict[str, list[str]]:
    code = PROBE.format(package=package, preload="torch" in ALLOWED[package])
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S, check=False
    )
    assert out.returncode == 0, f"importing {package} alone failed:\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_pure_package_imports_nothing_heavy(package):
    result = import_alone(package)
    forbidden = sorted(set(HEAVY) - set(ALLOWED[package]))
    bad = sorted(name for name in result["top"] if name in forbidden)
    assert bad == [], f"{package} imports {bad}; allowed heavy deps: {list(ALLOWED[package]) or 'none (stdlib only)'}"
    assert result["new_distributed"] == [], f"{package} imports {result['new_distributed']}"
    assert "gyre" in result["top"]
    other = sorted(set(result["gyre"]) - ALLOWED_GYRE[package])
    assert other == [], f"{package} imports gyre.{other}; allowed: {sorted(ALLOWED_GYRE[package])}"


def distributed_uses(path: Path) -> list[str]:
    """`import torch.distributed`, `from torch.distributed... import`, `from torch import distributed` and
    `torch.distributed` attribute access in one source file (docstrings and comments do not count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [f"{node.value.id}.{node.attr}"]
        else:
            continue
        if any(name == "torch.distributed" or name.startswith("torch.distributed.") for name in names):
            found.append(f"{path.name}:{node.lineno}")
    return found


@pytest.mark.parametrize("package", [p for p in sorted(ALLOWED) if "torch" in ALLOWED[p]])
def test_torch_packages_do_not_use_torch_distributed(package):
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations
    sources = sorted(path for root in spec.submodule_search_locations for path in Path(root).rglob("*.py"))
    assert sources
    uses = [use for path in sources for use in distributed_uses(path)]
    assert uses == [], f"{package} uses torch.distributed at {uses}"
