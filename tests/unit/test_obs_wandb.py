"""The W&B run of a training run (gyre/obs/sinks.py `WandbSink`): what reaches `wandb.init`, the group, tags and
config a real offline run records, and one W&B run across a resume (a second sink in the same run directory).

The offline runs are read back from their `.wandb` files: wandb 0.31 writes no `files/config.yaml` offline and no
longer ships a Python reader, so `offline_records` parses the file's LevelDB log framing (a 7-byte `:W&B` header,
then 32 KiB blocks of `crc32 | length u16 | type u8 | data` chunks) into `wandb.proto` `Record`s.
"""

import struct
import sys
import types
from pathlib import Path

import pytest

from gyre.config.checks import ConfigError
from gyre.config.obs import LoggingConfig
from gyre.obs.record import StepRecord
from gyre.obs.sinks import WANDB_RUN_ID_FILE, MetricsSinkError, WandbSink, build_metrics_logger, wandb_numbers


def record(step: int) -> StepRecord:
    return StepRecord(step=step, wall_time_s=10.0 * (step + 1), reward_mean=0.1 * step)


class FakeWandb(types.ModuleType):
    """A stand-in for the wandb package (named as such: used where wandb is not installed), recording its calls."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished, self.torn_down = [], [], 0, 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        fake = self

        class Run:
            id = kwargs.get("id") or f"fake{len(fake.inits)}"

            def log(self, data, step):
                fake.logged.append((step, data))

            def finish(self):
                fake.finished += 1

        return Run()

    def teardown(self):
        self.torn_down += 1


def test_logging_config_checks_group_and_tags():
    config = LoggingConfig(wandb_group="sweep-3", wandb_tags=["qwen", "x" * 64])
    assert (config.wandb_group, config.wandb_tags) == ("sweep-3", ["qwen", "x" * 64])
    assert (LoggingConfig().wandb_group, LoggingConfig().wandb_tags) == ("", [])
    for tags in (["a,b"], [""], ["x" * 65], [3], "qwen"):
        with pytest.raises(ConfigError, match=r"logging.wandb_tags=.*1 to 64 characters without ','"):
            LoggingConfig(wandb_tags=tags)
    with pytest.raises(ConfigError, match=r"logging\.wandb_group=3 is not allowed: expected a string"):
        LoggingConfig(wandb_group=3)


def test_wandb_sink_calls_init_log_finish_and_resumes_by_the_id_file(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run_dir = tmp_path / "2026-12-02_01-00-00"
    run_dir.mkdir()
    config = LoggingConfig(wandb="offline", wandb_project="p", wandb_group="g", wandb_tags=["t1", "t2"])
    logger = build_metrics_logger(config, run_dir, run_config={"seed": 1})
    logger.write(record(0))
    logger.close()
    first = {"mode": "offline", "dir": str(run_dir), "project": "p", "entity": None, "name": run_dir.name,
             "group": "g", "tags": ["t1", "t2"], "config": {"seed": 1}}  # fmt: skip
    assert fake.inits == [first]
    assert fake.logged == [(0, wandb_numbers(record(0)))] and fake.finished == 1
    assert fake.torn_down == 1  # its service process ends with the run (a forked worker runs no atexit)
    assert (run_dir / WANDB_RUN_ID_FILE).read_text() == "fake1\n"

    logger = build_metrics_logger(config, run_dir, run_config={"seed": 1})  # a resume: the same run directory
    logger.close()
    assert fake.inits[1] == {**first, "id": "fake1", "resume": "allow"}
    assert (run_dir / WANDB_RUN_ID_FILE).read_text() == "fake1\n"

    fake.inits.clear()
    build_metrics_logger(LoggingConfig(wandb="offline"), tmp_path / "bare", run_config=None).close()
    assert fake.inits[0]["group"] is None and fake.inits[0]["tags"] is None  # empty: W&B's own defaults


def test_wandb_sink_refuses_an_id_file_that_holds_no_run_id(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for text in ("", "\n", "a/b\n", "two words\n"):
        (tmp_path / WANDB_RUN_ID_FILE).write_text(text)
        with pytest.raises(MetricsSinkError, match=r"wandb_run_id holds .*not a W&B run id.*remove the file"):
            WandbSink(mode="offline", run_dir=tmp_path, project="gyre")
    assert fake.inits == []


def test_wandb_sink_without_the_package_says_how_to_fix(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(MetricsSinkError, match=r"wandb=offline needs the wandb package.*wandb=disabled"):
        WandbSink(mode="offline", run_dir=tmp_path, project="gyre")
    with pytest.raises(ValueError, match="mode='disabled' is not allowed"):
        WandbSink(mode="disabled", run_dir=tmp_path, project="gyre")


def offline_records(path: Path) -> list:
    """The `wandb.proto` `Record`s of one offline run's `.wandb` file (module docstring)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    records, chunks, pos = [], [], 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunks.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE/LAST
            records.append(wandb_internal_pb2.Record.FromString(b"".join(chunks)))
            chunks = []
    return records


def offline_runs(run_dir: Path) -> list[dict]:
    """Per offline run directory, in time order: its run record's fields and the steps its history logged."""
    runs = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        records = offline_records(path)
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        steps = [r.history.step.num for r in records if r.WhichOneof("record_type") == "history"]
        config = {c.key: c.value_json for c in run.config.update if c.key != "_wandb"}
        runs.append({"id": run.run_id, "project": run.project, "name": run.display_name, "group": run.run_group,
                     "tags": list(run.tags), "config": config, "steps": steps})  # fmt: skip
    return runs


@pytest.fixture
def real_wandb(monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed in this environment")
    for name in ("WANDB_MODE", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_RUN_GROUP", "WANDB_TAGS", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield wandb
    wandb.teardown()


def test_offline_run_records_group_tags_config_and_goes_on_after_a_resume(tmp_path, real_wandb):
    config = LoggingConfig(wandb="offline", wandb_project="gyre-test", wandb_group="g1", wandb_tags=["a", "b-2"])
    run_config = {"seed": 7, "algo": {"group_size": 4}}
    try:
        logger = build_metrics_logger(config, tmp_path, run_config=run_config)
    except Exception as error:  # wandb's own start-up (its service process) failing here is not gyre's to test
        if isinstance(error, MetricsSinkError):
            raise
        pytest.skip(f"wandb could not start offline here: {error}")
    logger.write(record(0))
    logger.write(record(1))
    logger.close()
    run_id = (tmp_path / WANDB_RUN_ID_FILE).read_text().strip()

    logger = build_metrics_logger(config, tmp_path, run_config=run_config)  # the resumed part, same run directory
    logger.write(record(2))
    logger.write(record(3))
    logger.close()

    expected = {"id": run_id, "project": "gyre-test", "name": tmp_path.name, "group": "g1", "tags": ["a", "b-2"],
                "config": {"seed": "7", "algo": '{"group_size":4}'}}  # fmt: skip
    # wandb 0.31 offline: the resumed part is a second offline-run directory under the same run id.
    assert offline_runs(tmp_path) == [{**expected, "steps": [0, 1]}, {**expected, "steps": [2, 3]}]
    assert (tmp_path / WANDB_RUN_ID_FILE).read_text() == run_id + "\n"
