"""`proxy.sampling.seed`: the proxy seeds every call from the run's seed, its execution and its prompt
(`gyre.engine.protocol.call_seed`), so a repeated run samples the same tokens on the same weights, over real HTTP on
127.0.0.1 to the serving stack with its embedded native engine (the tiny model, temperature 1)."""

from __future__ import annotations

import json

from proxy_stack import StackThread

from gyre.config import ProxyConfig, ServeConfig
from gyre.config.proxy import SamplingConfig
from gyre.traj.store import load_tree

TOKENS = 24


def sampled(tmp_path, seed: int | None, executions: list[str]) -> dict[str, tuple[tuple[int, ...], tuple[float, ...]]]:
    """One call per execution on a fresh stack: the recorded output ids and behavior log-probs of each."""
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=TOKENS, seed=seed)
    stack = StackThread(ServeConfig(proxy=ProxyConfig(sampling=sampling), executions=0), tmp_path)
    try:
        out = {}
        for execution in executions:
            key = stack.stack.registry.issue(execution).key
            body = {"model": "gyre", "max_tokens": TOKENS, "messages": [{"role": "user", "content": "say anything"}]}
            status, _ = stack.post("/v1/messages", json.dumps(body).encode(), key=key)
            assert status == 200
            response = load_tree(stack.stack.registry.records_dir / f"{execution}.jsonl").calls[0].response
            out[execution] = (tuple(response.ids), tuple(response.logprobs))
        return out
    finally:
        stack.stop()


def test_a_seeded_run_repeats_its_calls_token_for_token(tmp_path):
    first = sampled(tmp_path / "a", 11, ["g000000-e0000000", "g000000-e0000001"])
    again = sampled(tmp_path / "b", 11, ["g000000-e0000000"])
    other_run = sampled(tmp_path / "c", 12, ["g000000-e0000000"])
    assert again["g000000-e0000000"] == first["g000000-e0000000"]
    # Another execution of the same prompt, or another run seed, samples another stream.
    assert first["g000000-e0000001"][0] != first["g000000-e0000000"][0]
    assert other_run["g000000-e0000000"][0] != first["g000000-e0000000"][0]
