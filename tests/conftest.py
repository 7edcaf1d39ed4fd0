"""How the suite is ordered and what it starts ahead of time (docs/testing.md, "Running the suite").

- `warm_start` marks the modules that need the default warm start of the tiny model (cached under $GYRE_CACHE or
  ~/.cache/gyre; ~3.5 CPU minutes when it is not there yet). When the suite runs on several workers
  (`pytest -n 2 --dist loadfile --no-loadscope-reorder`; the README's command uses one process) and the warm start
  is not cached, the controller trains it in a background process from the start (its log:
  warm-start-for-pytest.log in the cache), ahead of the workers: they run at a lower priority (`nice 5`). The tests
  that need it wait on its lock (`warm_start_dir`), the others run meanwhile; at the session's end it is stopped if
  no test needed it. A single-process run trains it in the first test that needs it.
- Order: the integration modules first (with `--dist loadfile` the workers get whole modules in this order, so the
  long ones start early and the many short unit modules fill the end), those needing the warm start after the
  others, so that a background warm start has had time to finish before they ask for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

WARM_START = """
import logging
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
from gyre.config import WarmStartConfig
from gyre.tasks.demo.warm_start import warm_start_dir
print(warm_start_dir(config=WarmStartConfig(max_minutes=60)), flush=True)
"""
WORKER_NICENESS = 5  # the workers yield to the background warm start: the tests that need it come soon enough
_background: subprocess.Popen | None = None  # the background warm start, and the file its output goes to
_background_log = None


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        os.nice(WORKER_NICENESS)  # the worker and what its tests start; among themselves, as before


def _warm_start_cached() -> bool:
    from gyre.config import WarmStartConfig
    from gyre.models.tiny import default_cache_root
    from gyre.tasks.demo.warm_start import CACHE_PREFIX, read_meta, warm_start_key

    meta = read_meta(default_cache_root() / f"{CACHE_PREFIX}{warm_start_key(WarmStartConfig(), 0)}")
    return meta is not None and bool(meta.get("complete"))


def pytest_sessionstart(session: pytest.Session) -> None:
    global _background, _background_log
    config = session.config
    workers = getattr(config.option, "numprocesses", None)
    if hasattr(config, "workerinput") or not workers or _warm_start_cached():
        return  # an xdist worker, a single-process run, or nothing to train
    from gyre.models.tiny import default_cache_root

    root = default_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    _background_log = open(root / "warm-start-for-pytest.log", "w")  # noqa: SIM115 (closed at the session's end)
    _background = subprocess.Popen([sys.executable, "-c", WARM_START], stdout=_background_log, stderr=subprocess.STDOUT)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _background is None:
        return
    if _background.poll() is None:  # no test needed it (a subset of the suite): stop it, its staging dir removed
        _background.send_signal(signal.SIGINT)
        try:
            _background.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _background.kill()
            _background.wait()
    _background_log.close()


def _order(item: pytest.Item) -> tuple[int, int]:
    integration = "integration" in item.path.parts
    return (0 if integration else 1, 1 if item.get_closest_marker("warm_start") else 0)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=_order)  # stable: within each part, the usual order
