"""The layering between gyre's packages (docs/architecture.md, "Import rules"), checked in fresh interpreters.

Engines and trainers meet only through the shared model package (`gyre.models`) and the runtime; the proxy, a
light process, loads no torch; the runtime trains a model on task sets with a harness and loads no recipe, no demo
family and not the app that picks a recipe (issue 29: `python -m gyre.train` is the app package `gyre.train`, the
trainers are `gyre.trainer`). Each case imports a package and every module under it (`__main__` aside) alone in
a new interpreter, with a timeout, so another test's imports cannot hide a dependency, and lists the modules that
were loaded. (`gyre.config` loading no torch, hydra or numpy is checked in test_pure_packages.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

IMPORT_TIMEOUT_S = 300  # gyre.trainer imports megatron-core, which takes a while on a shared machine

PROBE = """
import importlib, json, pkgutil, sys
import {package}
for module in pkgutil.walk_packages({package}.__path__, "{package}."):  # every module, not only __init__
    if not module.name.endswith("__main__"):
        importlib.import_module(module.name)
print(json.dumps(sorted(sys.modules)))
"""

# package -> top-level modules or gyre packages that importing it (every module of it) must not load
FORBIDDEN = {
    "gyre.proxy": ("torch",),  # the server included: the engine protocol and its errors are stdlib
    "gyre.trainer": ("gyre.engine", "gyre.runtime"),  # trainers and engines meet only in the runtime
    "gyre.engine": ("gyre.trainer", "gyre.runtime"),
    "gyre.models": ("gyre.engine", "gyre.trainer", "gyre.proxy", "gyre.tasks"),
    # The runtime trains "a model, task sets, a harness": recipes (and the demo family they build on) sit above it,
    # as does the app (`python -m gyre.train`) that picks a recipe.
    "gyre.runtime": ("gyre.recipes", "gyre.tasks.demo", "gyre.train"),
}


def modules_loaded_by(package: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(package=package)],
        capture_output=True,
        text=True,
        timeout=IMPORT_TIMEOUT_S,
        check=False,
    )
    assert out.returncode == 0, f"importing {package} and its modules failed:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_loads_none_of_the_layers_it_must_not_import(package):
    loaded = modules_loaded_by(package)
    assert package in loaded
    for forbidden in FORBIDDEN[package]:
        bad = sorted(m for m in loaded if m == forbidden or m.startswith(forbidden + "."))
        assert bad == [], f"importing {package} loads {forbidden}: {bad[:10]}"
