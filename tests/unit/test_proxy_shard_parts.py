"""The pure parts of the proxy shards (docs/proxy.md, "Shards"): a shard's spec survives its JSON line, the shards'
counters add up (`gyre.proxy.stats.merged`), and a session issued with a key made elsewhere takes only a well-formed,
unused one."""

from __future__ import annotations

import pytest

from gyre.config.proxy import ProxyConfig, SamplingConfig
from gyre.proxy.sessions import ExecutionIdConflict, SessionRegistry, new_key
from gyre.proxy.shard import ShardSpec
from gyre.proxy.stats import ProxyStats, merged


def test_a_spec_survives_its_json_line():
    spec = ShardSpec(
        index=3,
        proxy=ProxyConfig(thinking="disabled", sampling=SamplingConfig(temperature=0.7, seed=5), model_names=["a"]),
        model_dir="/m",
        records_dir=None,
        engines={"cell-0": "http://127.0.0.1:1", "pool": "http://127.0.0.1:2"},
        engine_secret="s",
        admin_key="k",
        log_file="/r/train.log",
    )
    assert ShardSpec.from_json(spec.to_json()) == spec


def snapshot(answered: int, refused: dict, executions: dict, lost: dict) -> dict:
    stats = ProxyStats()
    route = stats.route("/v1/messages", "anthropic")
    route.requests = route.answered = answered
    route.refused.update(refused)
    route.requests += sum(refused.values())
    return stats.snapshot(executions, lost)


class Lost:
    def __init__(self, moved, unplaced):
        self.reason, self.moved, self.unplaced = "gone", moved, unplaced


def test_the_shards_counters_add_up_and_an_engine_lost_on_both_is_one_engine():
    one = snapshot(3, {"invalid_request": 1}, {"a": 2, "b": 1}, {"cell-1": Lost({"a": "cell-0"}, ())})
    two = snapshot(4, {"invalid_request": 2, "not_found": 1}, {"c": 4}, {"cell-1": Lost({}, ("c",))})
    total = merged([one, two])
    assert total["total"]["answered"] == 7 and total["total"]["requests"] == 11
    assert total["total"]["refused"] == {"invalid_request": 3, "not_found": 1}
    assert total["routes"]["/v1/messages"] == total["dialects"]["anthropic"] == total["total"]
    assert total["executions"] == {"a": {"recorded": 2}, "b": {"recorded": 1}, "c": {"recorded": 4}}
    assert total["engines_lost"] == {"cell-1": {"reason": "gone", "moved": 1, "unplaced": 1}}
    nothing = merged([])
    assert nothing["total"] == snapshot(0, {}, {}, {})["total"] and nothing["executions"] == {}


def test_a_session_takes_a_key_made_elsewhere_only_when_well_formed_and_unused():
    registry = SessionRegistry(vocab_size=10, make_builder=lambda payload: None, make_payload_cache=lambda: None)
    key = new_key()
    assert registry.issue("a", key=key).key == key and registry.by_key(key).execution == "a"
    with pytest.raises(ExecutionIdConflict):
        registry.issue("b", key=key)
    for bad in ("", "gyre-short", "other-" + "x" * 40, 12):
        with pytest.raises(ValueError, match="execution key"):
            registry.issue("c", key=bad)
    assert registry.by_execution("b") is None and registry.by_execution("c") is None
