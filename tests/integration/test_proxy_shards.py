"""Proxy shards over real processes and HTTP (docs/proxy.md, "Shards"; `gyre.proxy.shards`, `gyre.proxy.shard`).

Two shard processes in front of engine endpoints (threads, 127.0.0.1) serve executions the test places as the
controller does: SDK clients stream from the shard each was placed on; the controller's reroute moves every
execution with its calls in flight on its own shard (KV exported from the source engine and imported on the
destination); every call is recorded once, in its execution's record file; the shards' counters add up; the
controller heard every call's start and end. Then the edges: a close answered only once the call in flight was
recorded, a command to a killed shard failing fast with its reason, a shard that cannot start, the control route
refusing a wrong key. The engines hold the calls the test needs in flight (docs/testing.md, "Deterministic
in-flight tests"): the source engine until the reroute (`NativeEngine.hold`, then exactly two steps), the engine of
the closed execution until its close has reached the shard (`ScriptedEngine.hold`). Every wait is bounded and every
process is reaped.
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import time

import aiohttp
import anthropic
import pytest
from test_proxy_migration import endpoints, hold_then_step

from gyre.config.proxy import ProxyConfig, SamplingConfig
from gyre.engine.native import NativeEngine
from gyre.engine.remote import RemoteEngine
from gyre.engine.scripted import ScriptedEngine, chat_reply
from gyre.models.hf_weights import load_pretrained
from gyre.models.tiny import tiny_model_dir
from gyre.proxy.render import ChatTemplate
from gyre.proxy.sessions import new_key
from gyre.proxy.shard import CONTROL_PATH, ShardSpec
from gyre.proxy.shards import ProxyShards, ShardError
from gyre.traj.store import load_tree

CLIENTS = 4
MAX_NEW = 96
TIMEOUT_S = 240.0
ADMIN = "gyre-admin-test-shards"


def specs(count, urls, records_dir, *, model_dir=None, max_new=MAX_NEW):
    engines = {f"cell-{i}": url for i, url in enumerate(urls)}
    proxy = ProxyConfig(sampling=SamplingConfig(max_new_tokens=max_new))
    return [
        ShardSpec(
            index=i,
            proxy=proxy,
            model_dir=str(model_dir or tiny_model_dir()),
            records_dir=str(records_dir),
            engines=engines,
            engine_secret=None,
            admin_key=ADMIN,
        )
        for i in range(count)
    ]


def pids_alive(pids):
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def test_two_shards_serve_their_executions_and_move_their_calls_with_kv_on_a_reroute(tmp_path):
    model = load_pretrained(tiny_model_dir())
    factories = [lambda: NativeEngine(copy.deepcopy(model), max_running=16) for _ in range(3)]

    async def main(urls, threads):
        await threads[0].call_async(lambda engine: engine.hold(), 60)  # the calls wait there until moved
        shards = await ProxyShards.start(specs(2, urls, tmp_path / "records"))
        source = await RemoteEngine.connect(urls[0])
        heard = []
        try:
            names = [f"exec-{i}" for i in range(CLIENTS)]
            keys = {name: new_key() for name in names}
            for name in names:
                shards.place(name)
            await asyncio.gather(*(shards.open(name, keys[name], "cell-0") for name in names))
            assert sorted(shards.shard_of[name] for name in names) == [0, 0, 1, 1]
            ready, go = asyncio.Semaphore(0), asyncio.Event()

            async def client(name):
                sdk = anthropic.AsyncAnthropic(base_url=shards.url_of(name), api_key=keys[name], max_retries=0)
                prompt = [{"role": "user", "content": f"{name}: count to twenty."}]
                ready.release()
                await go.wait()
                async with sdk.messages.stream(model="gyre", max_tokens=MAX_NEW, messages=prompt) as stream:
                    deltas = [event.text async for event in stream if event.type == "text"]
                    final = await stream.get_final_message()
                await sdk.close()
                return "".join(deltas), final

            calls = [asyncio.ensure_future(client(name)) for name in names]
            for _ in calls:
                await ready.acquire()
            go.set()
            await hold_then_step(threads[0], CLIENTS, steps=2)  # all admitted together: 3 tokens each, held
            deadline = time.monotonic() + 60
            while len(shards.in_flight) < CLIENTS:  # the shards' start events reach the controller
                heard.append(len(shards.in_flight))
                if time.monotonic() > deadline:  # say what each side saw, so a miss can be told from a slow shard
                    seen = {"controller": sorted(shards.in_flight._calls), "shards": await shards.stats()}
                    raise AssertionError(f"the controller did not hear every call start: {seen}")
                await asyncio.sleep(0.01)
            heard.append(len(shards.in_flight))
            source.stop_accepting()  # the cell leaves rollout
            moves = [await shards.reroute(name, "cell-2") for name in names]  # each on its own shard
            await source.drain(abort_after_s=0.0)
            results = await asyncio.gather(*calls)
            closes = await asyncio.gather(*(shards.close(name, wait_s=10) for name in names))
            live = await shards.stats()
        finally:
            await source.close()
            await shards.stop()
        return names, moves, results, closes, live, shards, heard

    with endpoints(factories) as (urls, threads):
        names, moves, results, closes, live, shards, heard = asyncio.run(
            asyncio.wait_for(main(urls, threads), TIMEOUT_S)
        )
    assert max(heard) == CLIENTS and len(shards.in_flight) == 0  # every start heard, every end heard
    assert all(close == {"in_flight": 0, "final": True} for close in closes), closes
    migrated = sum(len(move.migrated) for move in moves)
    moved_mid_stream = 0
    for name, (streamed, final) in zip(names, results, strict=True):
        text = "".join(block.text for block in final.content if block.type == "text")
        assert streamed == text
        tree = load_tree(tmp_path / "records" / f"{name}.jsonl")
        assert len(tree.calls) == 1
        assert len(tree.calls[0].response.ids) == final.usage.output_tokens
        assert tree.calls[0].meta.engine in {"cell-0", "cell-0,cell-2", "cell-2"}  # never cell-1
        moved_mid_stream += tree.calls[0].meta.engine == "cell-0,cell-2"
    print(f"KV migrated: {migrated} of {CLIENTS}; continued on the destination: {moved_mid_stream}")
    # Held in flight on the source, every call still running there (all, unless one sampled its end within its
    # first 3 tokens) was migrated with its KV and continued on the destination; none was restarted.
    ended_on_source = sum(
        load_tree(tmp_path / "records" / f"{name}.jsonl").calls[0].meta.engine == "cell-0" for name in names
    )
    assert migrated == moved_mid_stream == CLIENTS - ended_on_source
    assert not any(move.restarted for move in moves)
    assert migrated >= CLIENTS // 2 and moved_mid_stream >= CLIENTS // 2
    total = shards.final_stats["total"]
    assert total["answered"] == total["recorded"] == CLIENTS and total["kv_migrated"] == moved_mid_stream, total
    assert live["total"]["recorded"] == CLIENTS and set(live["executions"]) == set(names)


def test_close_waits_for_the_call_in_flight_and_a_killed_shard_fails_its_commands(tmp_path):
    template = ChatTemplate.from_pretrained(tiny_model_dir())
    answer = "one two three four five"
    factory = lambda: ScriptedEngine(chat_reply(template, lambda request, prompt: answer))  # noqa: E731

    async def main(urls, threads):
        await threads[0].call_async(lambda engine: engine.hold(after_tokens=2), 60)  # in flight until released
        shards = await ProxyShards.start(specs(2, urls, tmp_path / "records"))
        pids = shards.pids
        try:
            key = new_key()
            shards.place("exec-a")
            await shards.open("exec-a", key, "cell-0")
            sdk = anthropic.AsyncAnthropic(base_url=shards.url_of("exec-a"), api_key=key, max_retries=0)
            hi = [{"role": "user", "content": "hi"}]
            call = asyncio.ensure_future(sdk.messages.create(model="gyre", max_tokens=50, messages=hi))
            await threads[0].call_async(lambda engine: engine.until_held(1), 60)  # the call is in flight, held
            closing = asyncio.ensure_future(shards.close("exec-a", wait_s=30))
            deadline = time.monotonic() + 60
            while True:  # the close reached the shard once the key stopped working (at once, the call still held)
                try:
                    await sdk.messages.count_tokens(model="gyre", messages=hi)
                except anthropic.AuthenticationError:
                    break
                assert time.monotonic() < deadline, "the close did not reach the shard"
                await asyncio.sleep(0.01)
            assert not closing.done()  # it waits for the held call
            await threads[0].call_async(lambda engine: engine.release(), 60)
            closed = await closing  # answered once the call ended and was recorded
            recorded = len(load_tree(tmp_path / "records" / "exec-a.jsonl").calls)
            message = await call
            await sdk.close()
            with pytest.raises(anthropic.AuthenticationError):  # its key stopped working at the close
                sdk = anthropic.AsyncAnthropic(base_url=shards.url_of("exec-a"), api_key=key, max_retries=0)
                await sdk.messages.create(model="gyre", max_tokens=5, messages=hi)
            await sdk.close()

            async with aiohttp.ClientSession() as http:  # the control route takes the admin key only
                for headers, status in (({}, 401), ({"x-api-key": key}, 403)):
                    async with http.get(shards.urls[1] + CONTROL_PATH, headers=headers) as answer:
                        assert answer.status == status

            os.kill(pids[1], signal.SIGKILL)
            shards.place("exec-x")  # shard 0 (both have none open: the lowest index)
            shards.place("exec-b")  # shard 1: fewer open executions
            assert (shards.shard_of["exec-x"], shards.shard_of["exec-b"]) == (0, 1)
            with pytest.raises(ShardError, match="proxy shard 1"):
                await asyncio.wait_for(shards.open("exec-b", new_key(), "cell-0"), 10)
            with pytest.raises(ShardError, match="is gone"):  # later commands fail at once
                await asyncio.wait_for(shards.close("exec-b", wait_s=1), 1)
            shards.place("exec-c")  # a gone shard takes no new execution
            assert shards.shard_of["exec-c"] == 0
            assert await shards.open("exec-c", new_key(), "cell-0") is None  # shard 0 serves on
        finally:
            await shards.stop()
        return closed, recorded, message, pids

    with endpoints([factory]) as (urls, threads):
        closed, recorded, message, pids = asyncio.run(asyncio.wait_for(main(urls, threads), TIMEOUT_S))
    assert closed == {"in_flight": 1, "final": True} and recorded == 1
    text = "".join(block.text for block in message.content if block.type == "text")
    assert text == answer and message.stop_reason == "end_turn"  # the held call went on to its end after the close
    assert pids_alive(pids) == []


def shard_children():
    """This process's children that run `gyre.proxy.shard` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat, open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
                if ppid == os.getpid() and b"gyre.proxy.shard" in cmdline.read():
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_a_shard_that_cannot_start_says_why_and_leaves_no_process(tmp_path):
    async def main():
        with pytest.raises(ShardError, match="exited with code"):
            await ProxyShards.start(specs(2, ["http://127.0.0.1:9"], tmp_path, model_dir=tmp_path / "no-model"))

    asyncio.run(asyncio.wait_for(main(), 120))
    assert shard_children() == []
