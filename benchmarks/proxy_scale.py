"""The proxy at the paper's traffic: long histories resent on every call, many agent-paced sessions, one proxy.

Processes (as `benchmarks/proxy_overhead.py`, whose children and clients this reuses): the scripted engine behind
the real engine endpoint (core 0), the real serving stack's proxy with the engine disabled (core 1), this load
generator (core 0). Every call is an Anthropic Messages streaming call whose history is a Claude-Code-like session
(a task, then tool-calling answers each followed by a ~1.2K-token tool result), extended by our answer and a new
tool result each call, as a harness resends it.

(1) CPU per request by history length (10K, 100K, 300K, 700K tokens): one session per length, its calls one at a
    time, the proxy process's CPU per call (all threads, /proc schedstat) vs `orjson.loads` of the same body on
    the proxy's core; the issue's bound is 3x at 700K.
(2) Throughput at ~100K-token histories: `--saturation-sessions` sessions calling back to back (engine answering at
    once): requests per second, the proxy's CPU per request and how busy its core is.
(3) Agent-paced at the paper's rate: `--sessions` sessions (the paper's 144 executions of one cell), histories drawn
    log-uniformly from 10K to 700K tokens, exponential tool time of mean `--tool-mean-s` (5.6 s: the paper's
    execution f3ad38e5 made 636 calls in about an hour, 0.18 per second), each call 4 tokens 25 ms apart; added
    latency = a call's total minus the median of direct engine calls of the same pacing (p50, p99).
Then the projection to a 48-cell cluster, with its assumptions stated in the JSON.

    python benchmarks/proxy_scale.py [--quick] [--out benchmarks/results/proxy_scale.json]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/proxy_scale.py` from anywhere
    sys.path.insert(0, str(REPO))

from benchmarks import proxy_overhead as po  # noqa: E402
from benchmarks.report import emit  # noqa: E402

LENGTHS = (10_000, 100_000, 300_000, 700_000)
PAPER = {
    "calls_per_execution_per_s": round(636 / 3600, 3),  # execution f3ad38e5: 636 requests in about an hour
    "executions_per_cell": 144,  # the 122B NL2RepoBench setup: 144 concurrent executions per cell
    "cells": 48,
}


async def cpu_by_history(http, engine: po.Child, proxy: po.Child, template, reps: int) -> list[dict]:
    await po.set_pace(http, engine, 0.0)
    rows = []
    for length in LENGTHS:
        (key,) = await po.issue_keys(http, proxy, 1)
        messages = po.long_history(template, length)
        before = po.cpu_s(proxy.pid)
        _, _, answer = await po.call_proxy(http, proxy.url, key, po.history_body(messages), keep_text=True)
        await asyncio.sleep(0.05)  # the first call's bookkeeping with it
        first_cpu = po.cpu_s(proxy.pid) - before
        costs, body = await po.next_turn_costs(http, proxy, engine, key, messages, answer, reps)
        cpu_ms, parse_ms = statistics.median(costs["proxy_cpu"]) * 1e3, statistics.median(costs["parse_cpu"]) * 1e3
        rows.append(
            {
                "history_tokens": await po.proxy_input_tokens(http, proxy.url, key, body),
                "body_bytes": int(statistics.median(costs["sizes"])),
                "first_call_cpu_ms": round(first_cpu * 1e3, 1),
                "cpu_ms_per_request": round(cpu_ms, 3),
                "json_parse_ms": round(parse_ms, 3),
                "cpu_over_parse": round(cpu_ms / parse_ms, 2),
            }
        )
        print(f"(1) {length:>7} tokens: {rows[-1]}", file=sys.stderr)
    return rows


async def session_loop(http, proxy, key, messages, end_s, totals: list[float], errors: list[str], wait=None):
    """Calls until `end_s`: each extends the history by our answer and a tool result; `wait()` between calls."""
    step = 0
    while time.perf_counter() < end_s:
        try:
            _, total, answer = await po.call_proxy(http, proxy.url, key, po.history_body(messages), keep_text=True)
        except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as error:
            errors.append(repr(error)[:200])
            return
        totals.append(total)
        po.next_turn(messages, answer, step)
        step += 1
        if wait is not None:
            await asyncio.sleep(min(wait(), max(0.0, end_s - time.perf_counter())))


async def first_calls(http, proxy, keys, histories, concurrency: int = 4) -> None:
    """Each session's first call (a fresh build of its whole history), a few at a time, before any measuring."""
    gate = asyncio.Semaphore(concurrency)

    async def one(key, messages):
        async with gate:
            _, _, answer = await po.call_proxy(http, proxy.url, key, po.history_body(messages), keep_text=True)
            po.next_turn(messages, answer, 10_000)

    await asyncio.gather(*(one(k, m) for k, m in zip(keys, histories, strict=True)))


async def saturation(http, engine, proxy, template, sessions: int, duration_s: float) -> dict:
    await po.set_pace(http, engine, 0.0)
    keys = await po.issue_keys(http, proxy, sessions)
    base = po.long_history(template, 100_000)
    histories = [[dict(m) for m in base] for _ in range(sessions)]
    for i, history in enumerate(histories):  # distinct sessions: each its own first message
        history[0] = {"role": "user", "content": [{"type": "text", "text": f"Session {i}: fix the failing tests."}]}
    await first_calls(http, proxy, keys, histories)
    totals: list[float] = []
    errors: list[str] = []
    cpu_before, started = po.cpu_s(proxy.pid), time.perf_counter()
    end = started + duration_s
    await asyncio.gather(
        *(session_loop(http, proxy, k, m, end, totals, errors) for k, m in zip(keys, histories, strict=True))
    )
    seconds = time.perf_counter() - started
    cpu = po.cpu_s(proxy.pid) - cpu_before
    last = await po.proxy_input_tokens(http, proxy.url, keys[0], po.history_body(histories[0]))
    return {
        "sessions": sessions,
        "history_tokens": {"from": 100_000, "to_at_the_end": last},
        "requests": len(totals),
        "requests_per_s": round(len(totals) / seconds, 1),
        "proxy_cpu_ms_per_request": round(cpu / max(len(totals), 1) * 1e3, 3),
        "proxy_core_busy": round(cpu / seconds, 3),
        "total_ms": po.dist_ms(totals),
        "errors": errors[:5],
    }


async def direct_floor(http, engine, setup: dict, calls: int) -> list[float]:
    """Totals of direct engine calls (engine protocol, a short prompt) with the agents' pacing."""
    conversation = po.Conversation(setup["base_ids"], setup["turn_ids"], 4)
    totals = []
    for _ in range(calls):
        _, total, _ = await po.call_direct(http, engine.url, conversation.direct_body())
        totals.append(total)
    return totals


async def agent_paced(http, engine, proxy, setup: dict, sessions: int, tool_mean_s: float, duration_s: float) -> dict:
    new_tokens, token_delay_s = 4, 0.025  # history_body's max_tokens: 4
    await po.set_pace(http, engine, token_delay_s)
    direct = await direct_floor(http, engine, setup, 40)
    rng = random.Random(11)
    lengths = [int(math.exp(rng.uniform(math.log(10_000), math.log(700_000)))) for _ in range(sessions)]
    keys = await po.issue_keys(http, proxy, sessions)
    template = setup["template"]
    histories = []
    for i, length in enumerate(lengths):
        history = po.long_history(template, length)
        history[0] = {"role": "user", "content": [{"type": "text", "text": f"Session {i}: fix the failing tests."}]}
        histories.append(history)
    await po.set_pace(http, engine, 0.0)
    await first_calls(http, proxy, keys, histories)
    await po.set_pace(http, engine, token_delay_s)
    totals: list[float] = []
    errors: list[str] = []
    cpu_before, started = po.cpu_s(proxy.pid), time.perf_counter()
    end = started + duration_s

    async def agent(key, messages):
        await asyncio.sleep(rng.uniform(0, tool_mean_s))  # staggered starts
        await session_loop(
            http, proxy, key, messages, end, totals, errors, wait=lambda: rng.expovariate(1 / tool_mean_s)
        )

    await asyncio.gather(*(agent(k, m) for k, m in zip(keys, histories, strict=True)))
    seconds = time.perf_counter() - started
    cpu = po.cpu_s(proxy.pid) - cpu_before
    floor_p50 = po.pct(direct, 50)
    return {
        "sessions": sessions,
        "history_tokens": {"drawn": "log-uniform 10K-700K", "median": int(statistics.median(lengths))},
        "tool_mean_s": tool_mean_s,
        "call": f"{new_tokens} tokens {token_delay_s * 1e3:.0f} ms apart",
        "requests": len(totals),
        "requests_per_s": round(len(totals) / seconds, 2),
        "proxy_cpu_ms_per_request": round(cpu / max(len(totals), 1) * 1e3, 3),
        "proxy_core_busy": round(cpu / seconds, 3),
        "direct_total_ms": po.dist_ms(direct),
        "proxy_total_ms": po.dist_ms(totals),
        "added_p50_ms": round((po.pct(totals, 50) - floor_p50) * 1e3, 2),
        "added_p99_ms": round((po.pct(totals, 99) - floor_p50) * 1e3, 2),
        "errors": errors[:5],
    }


class LeanSession:
    """One session's calls over one kept-alive connection, with as little client CPU as this can: its body built
    from the messages serialized once each (`po.history_body`'s bytes, not re-serialized per call), the streamed
    answer read raw and only its text deltas decoded. Section 4 runs the load generator on the cores it measures;
    aiohttp's client and a whole-body `orjson.dumps` cost ~1.3 ms a call there, a quarter of a shard's work."""

    TEXT = re.compile(rb'"text_delta","text":("(?:[^"\\]|\\.)*")')

    def __init__(self, url: str, key: str, messages: list[dict]) -> None:
        self.host, port = url.removeprefix("http://").split(":")
        self.port, self.key, self.messages = int(port), key, messages
        whole = po.history_body([])
        self.head, self.tail = whole[: -len(b"[]}")] + b"[", b"]}"
        self.parts = [orjson.dumps(m) for m in messages]
        self.reader = self.writer = None

    def _body(self) -> bytes:
        self.parts += [orjson.dumps(m) for m in self.messages[len(self.parts) :]]
        return self.head + b",".join(self.parts) + self.tail

    async def call(self) -> str:
        """One call; the answer's text."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        body = self._body()
        self.writer.write(
            b"POST /v1/messages HTTP/1.1\r\nHost: %s\r\nx-api-key: %s\r\nanthropic-version: 2023-06-01\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (self.host.encode(), self.key.encode(), len(body))
        )
        self.writer.write(body)
        raw = await self.reader.readuntil(b"\r\n0\r\n\r\n")  # the chunked stream's last chunk
        if not raw.startswith(b"HTTP/1.1 200") or b"message_stop" not in raw:
            raise RuntimeError(f"proxy call: {raw[:300]!r}")
        return "".join(orjson.loads(text) for text in self.TEXT.findall(raw))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def lean_loop(session: LeanSession, end_s: float, totals: list[float], errors: list[str]) -> None:
    step = 0
    while time.perf_counter() < end_s:
        started = time.perf_counter()
        try:
            answer = await session.call()
        except (RuntimeError, OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as error:
            errors.append(repr(error)[:200])
            return
        totals.append(time.perf_counter() - started)
        po.next_turn(session.messages, answer, step)
        step += 1


async def sharded_saturation(http, engine, template, shards: int, sessions: int, duration_s: float) -> dict:
    """(4) Section 2's load on `shards` proxy shard processes (`gyre.proxy.shards.ProxyShards`, as `python -m
    gyre.train proxy.shards=N` starts them), unpinned: they share the machine's cores with the engine and this load
    generator. Requests per second, and CPU per request of the shards, the engine and the load generator."""
    from gyre.config.proxy import ProxyConfig
    from gyre.models.tiny import tiny_model_dir
    from gyre.proxy.sessions import new_key
    from gyre.proxy.shard import ShardSpec
    from gyre.proxy.shards import ProxyShards

    await po.set_pace(http, engine, 0.0)
    records = tempfile.TemporaryDirectory(prefix="gyre-proxy-scale-shards-")  # as section 2's proxy: recorded
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, range(os.cpu_count()))  # the shards inherit every core
    try:
        specs = [
            ShardSpec(
                index=i,
                proxy=ProxyConfig(model_names=[po.MODEL], context_limit=4_000_000, max_body_bytes=256 << 20),
                model_dir=str(tiny_model_dir()),
                records_dir=records.name,
                engines={"engine": engine.url},
                engine_secret=None,
                admin_key="gyre-admin-bench",
            )
            for i in range(shards)
        ]
        proxies = await ProxyShards.start(specs)
    finally:
        os.sched_setaffinity(0, pinned)
    lean: list[LeanSession] = []
    try:
        names = [f"session-{i}" for i in range(sessions)]
        keys = [new_key() for _ in names]
        for name in names:
            proxies.place(name)
        await asyncio.gather(*(proxies.open(n, k, "engine") for n, k in zip(names, keys, strict=True)))
        base = po.long_history(template, 100_000)
        histories = [[dict(m) for m in base] for _ in names]
        for i, history in enumerate(histories):
            history[0] = {"role": "user", "content": [{"type": "text", "text": f"Session {i}: fix the failing tests."}]}
        for name, key, history in zip(names, keys, histories, strict=True):  # each session's first call
            _, _, answer = await po.call_proxy(
                http, proxies.url_of(name), key, po.history_body(history), keep_text=True
            )
            po.next_turn(history, answer, 10_000)
        pids = proxies.pids
        lean = [LeanSession(proxies.url_of(n), k, m) for n, k, m in zip(names, keys, histories, strict=True)]
        totals: list[float] = []
        errors: list[str] = []
        shard_cpu = sum(map(po.cpu_s, pids))
        engine_cpu, own_cpu, started = po.cpu_s(engine.pid), time.process_time(), time.perf_counter()
        end = started + duration_s
        await asyncio.gather(*(lean_loop(session, end, totals, errors) for session in lean))
        seconds = time.perf_counter() - started
        shard_cpu = sum(map(po.cpu_s, pids)) - shard_cpu
        engine_cpu, own_cpu = po.cpu_s(engine.pid) - engine_cpu, time.process_time() - own_cpu
    finally:
        for session in lean:
            session.close()
        await proxies.stop()
        records.cleanup()
    per = max(len(totals), 1) / 1e3
    return {
        "shards": shards,
        "sessions": sessions,
        "requests": len(totals),
        "requests_per_s": round(len(totals) / seconds, 1),
        "cpu_ms_per_request": {
            "shards": round(shard_cpu / per, 3),
            "engine": round(engine_cpu / per, 3),
            "load_generator": round(own_cpu / per, 3),
        },
        "cores_busy": round((shard_cpu + engine_cpu + own_cpu) / seconds, 2),
        "total_ms": po.dist_ms(totals),
        "errors": errors[:5],
    }


def projection(paced: dict, by_history: list[dict]) -> dict:
    rate = PAPER["calls_per_execution_per_s"] * PAPER["executions_per_cell"] * PAPER["cells"]
    cpu_ms = paced["proxy_cpu_ms_per_request"]
    cores = rate * cpu_ms / 1e3
    return {
        "assumptions": {
            **PAPER,
            "cpu_ms_per_request": f"{cpu_ms} (section 3's mix of 10K-700K histories, this machine's cores)",
            "one_proxy_thread_usable": "70% of one core (queueing keeps p99 bounded below that)",
        },
        "cluster_requests_per_s": round(rate, 1),
        "proxy_cores_needed": round(cores, 2),
        "proxy_threads_needed_at_70pct": math.ceil(cores / 0.7),
        "at_700k_only": {
            "cpu_ms_per_request": by_history[-1]["cpu_ms_per_request"],
            "proxy_cores_needed": round(rate * by_history[-1]["cpu_ms_per_request"] / 1e3, 2),
        },
    }


async def run(args, setup, engine, proxy) -> dict:
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
    ) as http:
        sharded = []
        for count in (1, 2):
            sharded.append(
                await sharded_saturation(
                    http, engine, setup["template"], count, 4 if args.quick else 32, 3.0 if args.quick else 8.0
                )
            )
            print(f"(4) {sharded[-1]}", file=sys.stderr)
        speedup = sharded[1]["requests_per_s"] / max(sharded[0]["requests_per_s"], 1e-9)
        shards = {
            "shards_saturation_100k": sharded,
            "two_shards_over_one": round(speedup, 2),
            "target_two_shards": ">= 1.7x one shard's requests per second at 100K-token histories, 2 cores",
            "met_two_shards": speedup >= 1.7,
        }
        if args.shards_only:
            return shards
        by_history = await cpu_by_history(http, engine, proxy, setup["template"], reps=2 if args.quick else 10)
        saturated = await saturation(
            http, engine, proxy, setup["template"], 4 if args.quick else 32, 3.0 if args.quick else 8.0
        )
        print(f"(2) {saturated}", file=sys.stderr)
        paced = await agent_paced(
            http,
            engine,
            proxy,
            setup,
            8 if args.quick else args.sessions,
            args.tool_mean_s,
            10.0 if args.quick else 60.0,
        )
        print(f"(3) {paced}", file=sys.stderr)
    return {
        "shards": 1,
        "cpu_by_history": by_history,
        "saturation_100k": saturated,
        "agent_paced": paced,
        "projection_48_cells": projection(paced, by_history),
        **shards,
        "target_cpu_700k": "cpu_ms_per_request <= 3 x json_parse_ms",
        "met_cpu_700k": by_history[-1]["cpu_over_parse"] <= 3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few samples, short phases")
    parser.add_argument("--sessions", type=int, default=PAPER["executions_per_cell"])
    parser.add_argument("--tool-mean-s", type=float, default=5.6)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--shards-only", action="store_true", help="section 4 only: 1 and 2 proxy shards")
    args = parser.parse_args()
    if args.sessions < 1 or args.tool_mean_s <= 0:
        raise SystemExit("proxy_scale: --sessions must be >= 1 and --tool-mean-s > 0")

    from gyre.models.tiny import tiny_model_dir
    from gyre.proxy.render import ChatTemplate

    setup = po.prepare(ChatTemplate.from_pretrained(tiny_model_dir()))
    po._pin(po.ENGINE_CORE)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gyre-proxy-scale-logs-") as logs:
        engine = po.Child("engine", po.ENGINE_CORE, Path(logs), "--token-ids", ",".join(map(str, setup["token_ids"])))
        try:
            proxy = po.Child("proxy", po.PROXY_CORE, Path(logs), "--engine-url", engine.url)
            try:
                result = asyncio.run(run(args, setup, engine, proxy))
            finally:
                proxy.stop()
        finally:
            engine.stop()
    emit(
        {
            "benchmark": "proxy_scale",
            "mode": "quick" if args.quick else "full",
            "pinning": {"engine": po.ENGINE_CORE, "load_generator": po.ENGINE_CORE, "proxy": po.PROXY_CORE},
            **result,
            "seconds": round(time.perf_counter() - started, 1),
            "cpus": os.cpu_count(),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
