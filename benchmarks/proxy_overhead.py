"""What gyre's proxy costs over calling the engine endpoint directly, every figure against its floor in the same run.

Processes (2 cores are shared by load generator, proxy and engine, so figures are compared, not quoted):
- engine: `gyre.engine.scripted.ScriptedEngine`, paced (a cheap, deterministic, decode-like stand-in: each request
  streams max_new_tokens plain-text token ids of the tiny tokenizer, one per chunk, `token_delay_s` apart) served by
  the real `gyre.engine.endpoint.EngineServer`, pinned to core 0;
- proxy: the real stack of `gyre.serve.stack.build_stack` (engine disabled, the engine endpoint as `engine_urls`,
  records written to a temporary directory), pinned to core 1;
- pass-through: a minimal relay on the same HTTP stack (aiohttp server + one shared ClientSession with
  TCPConnector(limit=0), orjson), POST /generate -> engine, bytes streamed back; pinned to core 1;
- the load generator (this process) runs on core 0 with the engine.

"direct" = the engine protocol (POST /generate, stream=true) to the endpoint; "proxy" = an Anthropic Messages
streaming call through the proxy, which builds the prompt and sends the same protocol. Latency of a call: `total`
(request sent -> stream's end) and `ttft` (-> first chunk carrying output tokens / first text delta).

(a) one session, calls alternating direct / proxy: added = p50(proxy total) - p50(direct total); target <= 1 ms.
(b) 512 sessions (64 with `--quick`; one execution key each) alternating a streamed call and exponential tool
    time, conversations growing by each answer and a new user turn, offered load a fraction of (c)'s saturation:
    direct phase, then proxy phase with the same pacing; added p50 <= 2 ms, p99 <= 10 ms.
(c) saturation: 64 clients back to back (8 tokens, 1 ms apart) through the pass-through and the proxy, alternated
    twice; req/s ratio proxy / pass-through >= 0.7 (and proxy CPU per request vs the pass-through's).
(d) a ~700K-token Anthropic history extended by one answer and one user turn per request: proxy process CPU per
    request (all threads, /proc schedstat; engine answering 4 tokens at once) vs `orjson.loads` of that body on the
    proxy's core; target <= 3x. An in-process breakdown of the request path follows the same request sequence.

    python benchmarks/proxy_overhead.py [--quick] [--out benchmarks/results/proxy_overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python benchmarks/proxy_overhead.py` from anywhere
    sys.path.insert(0, str(REPO))

from benchmarks.report import emit  # noqa: E402

ENGINE_CORE, PROXY_CORE = 0, 1
MODEL = "gyre"
STOP_ID = 2  # the tiny template's end of turn: never emitted by the paced engine (plain-text ids only)
SYSTEM = "You are a coding agent working in a repository. Use the tools to read and edit files. " * 8
TOOL_RESULT = "".join(f"line {i}: def function_{i}(x): return x * {i}  # comment\n" for i in range(40))
TOOLS = [
    {
        "name": f"tool_{i}",
        "description": "Does one thing to the workspace.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    for i in range(24)
]
CALL_TIMEOUT = aiohttp.ClientTimeout(total=120)


# ============================================================================ child processes


def _pin(core: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > core:
        os.sched_setaffinity(0, {core})


async def _serve_until_signal(ready: dict) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    print(json.dumps(ready), flush=True)
    await stop.wait()


async def _engine_main(args) -> None:
    from gyre.engine.endpoint import EngineServer
    from gyre.engine.scripted import ScriptedEngine

    token_ids = [int(t) for t in args.token_ids.split(",")]
    # Every request runs at once (no queueing) and streams the ids round and round until max_new_tokens ("length").
    engine = ScriptedEngine(
        lambda request: itertools.cycle(token_ids),
        token_delay_s=args.token_delay_s,
        max_running=100_000,
        kv_tokens=10**9,
    )
    server = EngineServer(engine)

    async def pace(http: web.Request) -> web.Response:
        engine.token_delay_s = float((await http.json())["token_delay_s"])
        return web.json_response({"token_delay_s": engine.token_delay_s})

    server.app.router.add_post("/bench/pace", pace)  # a benchmark route on the real endpoint app
    url = await server.start()
    try:
        await _serve_until_signal({"url": url})
    finally:
        await server.stop()


async def _proxy_main(args) -> None:
    from gyre.config import EngineConfig, ServeConfig
    from gyre.config.proxy import ProxyConfig
    from gyre.serve.stack import build_stack

    cfg = ServeConfig(
        proxy=ProxyConfig(model_names=[MODEL], context_limit=4_000_000, max_body_bytes=256 << 20),
        engine=EngineConfig(enabled=False),
        engine_urls=[args.engine_url],
        executions=0,
    )
    with tempfile.TemporaryDirectory(prefix="gyre-proxy-overhead-") as records:
        stack = await build_stack(cfg, records_dir=records)
        try:
            await _serve_until_signal({"url": stack.proxy.url, "admin_key": stack.proxy.admin_key})
        finally:
            await stack.close()


async def _passthrough_main(args) -> None:
    """The floor of (c): relay POST /generate to the engine and stream its bytes back, nothing else."""
    upstream_url = args.engine_url.rstrip("/") + "/generate"
    client = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), connector=aiohttp.TCPConnector(limit=0)
    )

    async def relay(http: web.Request) -> web.StreamResponse:
        body = await http.read()
        async with client.post(upstream_url, data=body, headers={"Content-Type": "application/json"}) as upstream:
            response = web.StreamResponse(
                status=upstream.status, headers={"Content-Type": upstream.headers.get("Content-Type", "")}
            )
            await response.prepare(http)
            async for data in upstream.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response

    app = web.Application(client_max_size=256 << 20)
    app.router.add_post("/generate", relay)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        await _serve_until_signal({"url": f"http://127.0.0.1:{port}"})
    finally:
        await runner.cleanup()
        await client.close()


def child_main(args) -> None:
    _pin(args.core)
    with contextlib.suppress(ImportError):
        import uvloop  # the stack docs/proxy.md measured; absent here, then plain asyncio for every process alike

        uvloop.install()
    role = {"engine": _engine_main, "proxy": _proxy_main, "passthrough": _passthrough_main}[args.role]
    asyncio.run(role(args))


class Child:
    """A benchmark role in its own pinned process; `ready` is its first stdout line (JSON). Stopped by PID."""

    def __init__(self, role: str, core: int, log_dir: Path, *extra: str, timeout_s: float = 120.0):
        self.role = role
        self.log = open(log_dir / f"{role}.log", "wb")  # noqa: SIM115 (closed in stop)
        command = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--core", str(core), *extra]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log, cwd=REPO)
        lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.process.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            self.stop()
            raise TimeoutError(f"{role} did not start within {timeout_s} s (log: {self.log.name})") from None
        if not line:
            self.stop()
            raise RuntimeError(f"{role} exited at start (log: {self.log.name})")
        self.ready = json.loads(line)
        self.url = self.ready["url"]

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(15)
        self.log.close()


def cpu_s(pid: int) -> float:
    """CPU seconds of every thread of `pid` (scheduler nanoseconds from /proc; Linux)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with (
            contextlib.suppress(FileNotFoundError, ProcessLookupError),
            open(f"/proc/{pid}/task/{task}/schedstat") as f,
        ):
            total += int(f.read().split()[0])
    return total / 1e9


# ============================================================================ load generation


def pct(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100])."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def dist_ms(values: list[float]) -> dict:
    return {f"p{q}": round(pct(values, q) * 1e3, 3) for q in (50, 90, 99)} | {"n": len(values)}


class Conversation:
    """One agent's Anthropic conversation and the engine prompt a direct call of the same size would carry."""

    def __init__(self, base_ids: list[int], turn_ids: list[int], new_tokens: int):
        self.messages: list[dict] = [{"role": "user", "content": "Fix the failing test in tests/test_core.py."}]
        self.prompt_ids = list(base_ids)
        self.turn_ids = turn_ids
        self.new_tokens = new_tokens
        self.calls = 0

    def proxy_body(self) -> bytes:
        body = {
            "model": MODEL,
            "max_tokens": self.new_tokens,
            "stream": True,
            "system": SYSTEM,
            "tools": TOOLS,
            "messages": self.messages,
        }
        return orjson.dumps(body)

    def direct_body(self) -> bytes:
        params = {"max_new_tokens": self.new_tokens, "stop_token_ids": [STOP_ID]}
        request = {"request_id": uuid.uuid4().hex, "execution_id": "direct", "input_ids": self.prompt_ids}
        return orjson.dumps(
            {"request": request | {"params": params}, "stream": True, "submission_id": uuid.uuid4().hex}
        )

    def extend(self, answer: str, output_ids: int) -> None:
        """The harness's next turn: our answer echoed back, then a new user message (a tool's output)."""
        self.calls += 1
        self.messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
        self.messages.append({"role": "user", "content": f"Output of step {self.calls}: tests still fail."})
        self.prompt_ids.extend(self.prompt_ids[-output_ids:] + self.turn_ids)


async def call_direct(http: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, float, str]:
    started = time.perf_counter()
    ttft = None
    async with http.post(url + "/generate", data=body, headers={"Content-Type": "application/json"}) as response:
        if response.status != 200:
            raise RuntimeError(f"direct call: HTTP {response.status}: {(await response.read())[:300]!r}")
        async for line in response.content:
            if ttft is None and b'"token_ids":[]' not in line:
                ttft = time.perf_counter() - started
    return ttft or float("nan"), time.perf_counter() - started, ""


async def call_proxy(
    http: aiohttp.ClientSession, url: str, key: str, body: bytes, *, keep_text: bool
) -> tuple[float, float, str]:
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01", "Content-Type": "application/json"}
    started = time.perf_counter()
    ttft = None
    text: list[str] = []
    stopped = False
    async with http.post(url + "/v1/messages", data=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"proxy call: HTTP {response.status}: {(await response.read())[:300]!r}")
        async for line in response.content:
            if line.startswith(b"data:") and b'"content_block_delta"' in line:
                if ttft is None:
                    ttft = time.perf_counter() - started
                if keep_text:
                    text.append(orjson.loads(line[5:])["delta"].get("text", ""))
            elif line.startswith(b"data:") and b'"message_stop"' in line:
                stopped = True
            elif line.startswith(b"event: error"):
                raise RuntimeError(f"proxy call ended with an error event: {await response.content.read()!r}")
    if not stopped:
        raise RuntimeError("proxy call: the stream ended without message_stop")
    return ttft or float("nan"), time.perf_counter() - started, "".join(text)


async def issue_keys(http: aiohttp.ClientSession, proxy: Child, count: int) -> list[str]:
    headers = {"Authorization": f"Bearer {proxy.ready['admin_key']}"}
    keys = []
    for _ in range(count):
        async with http.post(proxy.url + "/gyre/executions", data=b"{}", headers=headers) as response:
            keys.append((await response.json())["key"])
    return keys


async def set_pace(http: aiohttp.ClientSession, engine: Child, token_delay_s: float) -> None:
    async with http.post(engine.url + "/bench/pace", json={"token_delay_s": token_delay_s}) as response:
        response.raise_for_status()


# ============================================================================ (a) one session


async def one_session(http, engine: Child, proxy: Child, setup: dict, calls: int, warmup: int) -> dict:
    await set_pace(http, engine, 0.002)
    (key,) = await issue_keys(http, proxy, 1)
    conversation = Conversation(setup["base_ids"], setup["turn_ids"], new_tokens=16)
    proxy_body, direct_body = conversation.proxy_body(), conversation.direct_body()
    sides: dict[str, list[tuple[float, float]]] = {"direct": [], "proxy": []}
    for index in range(warmup + calls):
        order = ("direct", "proxy") if index % 2 == 0 else ("proxy", "direct")
        for side in order:
            if side == "direct":
                ttft, total, _ = await call_direct(http, engine.url, direct_body)
            else:
                ttft, total, _ = await call_proxy(http, proxy.url, key, proxy_body, keep_text=False)
            if index >= warmup:
                sides[side].append((ttft, total))
    direct_total = [t for _, t in sides["direct"]]
    proxy_total = [t for _, t in sides["proxy"]]
    paired = [p - d for p, d in zip(proxy_total, direct_total, strict=True)]
    added = pct(proxy_total, 50) - pct(direct_total, 50)
    return {
        "what": "one session, sequential streamed calls (16 tokens, 2 ms apart), direct and proxy alternating",
        "direct_total_ms": dist_ms(direct_total),
        "proxy_total_ms": dist_ms(proxy_total),
        "direct_ttft_ms": dist_ms([t for t, _ in sides["direct"]]),
        "proxy_ttft_ms": dist_ms([t for t, _ in sides["proxy"]]),
        "added_p50_ms": round(added * 1e3, 3),
        "added_ttft_p50_ms": round(
            (pct([t for t, _ in sides["proxy"]], 50) - pct([t for t, _ in sides["direct"]], 50)) * 1e3, 3
        ),
        "paired_difference_p50_ms": round(pct(paired, 50) * 1e3, 3),
        "target": "added_p50_ms <= 1",
        "met": added * 1e3 <= 1.0,
    }


# ============================================================================ (c) saturation


async def saturate(http, target: str, url: str, keys: list[str], body_of, duration_s: float, pids: dict) -> dict:
    """`len(keys)` clients back to back for `duration_s` (the first 20% is warm-up); completed calls per second."""
    warm_until = time.perf_counter() + duration_s * 0.2
    end = warm_until + duration_s * 0.8
    done: list[float] = []
    cpu_start: dict[str, float] = {}

    async def client(index: int) -> None:
        body = body_of(index)
        while time.perf_counter() < end:
            if target == "proxy":
                _, total, _ = await call_proxy(http, url, keys[index], body, keep_text=False)
            else:
                _, total, _ = await call_direct(http, url, body)
            now = time.perf_counter()
            if warm_until <= now <= end:
                done.append(total)

    async def window() -> None:
        await asyncio.sleep(max(0.0, warm_until - time.perf_counter()))
        cpu_start.update({name: cpu_s(pid) for name, pid in pids.items()})

    tasks = [asyncio.ensure_future(client(i)) for i in range(len(keys))]
    watcher = asyncio.ensure_future(window())
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    cpu_end = {name: cpu_s(pid) for name, pid in pids.items()}
    await asyncio.wait_for(asyncio.gather(*tasks, watcher), timeout=60)
    seconds = duration_s * 0.8
    cpu = {name: round((cpu_end[name] - cpu_start[name]) / seconds, 3) for name in pids}
    return {
        "requests_per_s": round(len(done) / seconds, 1),
        "calls": len(done),
        "total_ms": dist_ms(done),
        "cpu_cores_busy": cpu,
        "relay_cpu_ms_per_request": (
            round((cpu_end["relay"] - cpu_start["relay"]) / max(1, len(done)) * 1e3, 3) if "relay" in pids else None
        ),
    }


async def saturation(http, engine: Child, proxy: Child, passthrough: Child, setup: dict, duration_s: float) -> dict:
    clients = 64
    await set_pace(http, engine, 0.001)
    keys = await issue_keys(http, proxy, clients)
    conversations = [Conversation(setup["base_ids"], setup["turn_ids"], new_tokens=8) for _ in range(clients)]
    me = os.getpid()
    runs: dict[str, list[dict]] = {"passthrough": [], "proxy": []}
    direct = await saturate(
        http,
        "direct",
        engine.url,
        keys,
        lambda i: conversations[i].direct_body(),
        duration_s,
        {"engine": engine.pid, "load_generator": me},
    )
    for _ in range(2):
        runs["passthrough"].append(
            await saturate(
                http,
                "passthrough",
                passthrough.url,
                keys,
                lambda i: conversations[i].direct_body(),
                duration_s,
                {"relay": passthrough.pid, "engine": engine.pid, "load_generator": me},
            )
        )
        runs["proxy"].append(
            await saturate(
                http,
                "proxy",
                proxy.url,
                keys,
                lambda i: conversations[i].proxy_body(),
                duration_s,
                {"relay": proxy.pid, "engine": engine.pid, "load_generator": me},
            )
        )
    floor = statistics.mean(r["requests_per_s"] for r in runs["passthrough"])
    gyre_rps = statistics.mean(r["requests_per_s"] for r in runs["proxy"])
    floor_cpu = statistics.mean(r["relay_cpu_ms_per_request"] for r in runs["passthrough"])
    gyre_cpu = statistics.mean(r["relay_cpu_ms_per_request"] for r in runs["proxy"])
    ratio = gyre_rps / floor
    return {
        "what": f"{clients} clients back to back, 8 tokens per call 1 ms apart; pass-through and proxy alternated x2",
        "direct_engine": direct,
        "passthrough": runs["passthrough"],
        "proxy": runs["proxy"],
        "passthrough_requests_per_s": round(floor, 1),
        "proxy_requests_per_s": round(gyre_rps, 1),
        "throughput_ratio": round(ratio, 3),
        "passthrough_cpu_ms_per_request": round(floor_cpu, 3),
        "proxy_cpu_ms_per_request": round(gyre_cpu, 3),
        "cpu_per_request_ratio": round(gyre_cpu / floor_cpu, 2),
        # When the relay's core is the bottleneck, throughput ~ 1 / CPU per request: an estimate that other work
        # on the shared cores (which lowers both measured req/s, unevenly) does not move.
        "cpu_bound_throughput_ratio": round(floor_cpu / gyre_cpu, 3),
        "target": "throughput_ratio >= 0.7",
        "met": ratio >= 0.7,
    }


# ============================================================================ (b) 512 agent-paced sessions


@dataclasses.dataclass
class AgentPhase:
    """One phase of (b): where the calls go and the window whose calls are measured (the first 20% is warm-up)."""

    side: str  # "direct" | "proxy"
    url: str
    duration_s: float
    samples: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (ttft, total) seconds
    errors: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.warm_until = time.perf_counter() + self.duration_s * 0.2
        self.end = self.warm_until + self.duration_s * 0.8


async def agent(phase: AgentPhase, http, key: str, conversation: Conversation, start: float, waits: list[float]):
    """One agent: call, tool time, call, ... until the phase ends (sleeps are cut at the end)."""
    await asyncio.sleep(min(start, max(0.0, phase.end - time.perf_counter())))
    for wait in waits:
        started = time.perf_counter()
        if started >= phase.end:
            return
        try:
            if phase.side == "direct":
                ttft, total, _ = await call_direct(http, phase.url, conversation.direct_body())
                text = "x"
            else:
                ttft, total, text = await call_proxy(http, phase.url, key, conversation.proxy_body(), keep_text=True)
        except (RuntimeError, aiohttp.ClientError, asyncio.TimeoutError) as error:
            phase.errors.append(repr(error)[:200])
            return
        if started >= phase.warm_until:
            phase.samples.append((ttft, total))
        conversation.extend(text, conversation.new_tokens)
        await asyncio.sleep(min(wait, max(0.0, phase.end - time.perf_counter())))


async def agents(
    http, engine: Child, proxy: Child, setup: dict, sessions: int, duration_s: float, saturation_rps: float
) -> dict:
    new_tokens, token_delay_s, load_fraction = 8, 0.025, 0.35
    await set_pace(http, engine, token_delay_s)
    call_s = new_tokens * token_delay_s
    if saturation_rps <= 0:  # the agents' pacing is a fraction of it
        raise SystemExit("proxy_overhead: the proxy completed no call in the saturation phase (a machine too loaded)")
    tool_mean_s = max(1.0, sessions / (load_fraction * saturation_rps) - call_s)
    keys = await issue_keys(http, proxy, sessions)
    me = os.getpid()
    phases = {}
    for side in ("direct", "proxy"):
        rng = random.Random(7)  # the same start offsets and tool times in both phases
        phase = AgentPhase(side=side, url=engine.url if side == "direct" else proxy.url, duration_s=duration_s)
        conversations = [Conversation(setup["base_ids"], setup["turn_ids"], new_tokens) for _ in range(sessions)]
        starts = [rng.uniform(0, tool_mean_s) for _ in range(sessions)]
        calls_each = int(duration_s / tool_mean_s * 4) + 8
        waits = [[rng.expovariate(1 / tool_mean_s) for _ in range(calls_each)] for _ in range(sessions)]
        pids = {"engine": engine.pid, "load_generator": me} | ({"proxy": proxy.pid} if side == "proxy" else {})
        tasks = [
            asyncio.ensure_future(agent(phase, http, keys[i], conversations[i], starts[i], waits[i]))
            for i in range(sessions)
        ]
        await asyncio.sleep(max(0.0, phase.warm_until - time.perf_counter()))
        cpu_start = {name: cpu_s(pid) for name, pid in pids.items()}
        await asyncio.sleep(max(0.0, phase.end - time.perf_counter()))
        cpu_end = {name: cpu_s(pid) for name, pid in pids.items()}
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
        seconds = duration_s * 0.8
        phases[side] = {
            "calls": len(phase.samples),
            "requests_per_s": round(len(phase.samples) / seconds, 1),
            "total_ms": dist_ms([t for _, t in phase.samples]),
            "ttft_ms": dist_ms([t for t, _ in phase.samples]),
            "cpu_cores_busy": {name: round((cpu_end[name] - cpu_start[name]) / seconds, 3) for name in pids},
            "errors": phase.errors[:5],
            "_totals": [t for _, t in phase.samples],
        }
    direct_totals, proxy_totals = phases["direct"].pop("_totals"), phases["proxy"].pop("_totals")
    added_p50 = (pct(proxy_totals, 50) - pct(direct_totals, 50)) * 1e3
    added_p99 = (pct(proxy_totals, 99) - pct(direct_totals, 99)) * 1e3
    return {
        "what": (
            f"{sessions} sessions, each: streamed call ({new_tokens} tokens, {token_delay_s * 1e3:.0f} ms apart), then "
            f"exponential tool time (mean {tool_mean_s:.2f} s); direct phase then proxy phase, same pacing"
        ),
        "sessions": sessions,
        "tool_mean_s": round(tool_mean_s, 3),
        "saturation_requests_per_s_from_c": saturation_rps,
        "load_over_saturation": round(phases["proxy"]["requests_per_s"] / saturation_rps, 3),
        "direct": phases["direct"],
        "proxy": phases["proxy"],
        "added_p50_ms": round(added_p50, 3),
        "added_p99_ms": round(added_p99, 3),
        "added_ttft_p50_ms": round(phases["proxy"]["ttft_ms"]["p50"] - phases["direct"]["ttft_ms"]["p50"], 3),
        "target": "added_p50_ms <= 2 and added_p99_ms <= 10",
        "met": added_p50 <= 2 and added_p99 <= 10,
    }


# ============================================================================ (d) 700K-token history


def long_history(template, target_tokens: int) -> list[dict]:
    """Claude-Code-like messages: a task, then tool-calling answers each followed by a ~1.2K-token tool result."""
    per_step = len(template.encode(TOOL_RESULT)) + 40
    messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "Fix the failing tests."}]}]
    for step in range(target_tokens // per_step + 1):
        call_id = f"toolu_{step:06d}"
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": f"Step {step}: reading the next file."},
                    {"type": "tool_use", "id": call_id, "name": "tool_1", "input": {"path": f"src/f{step}.py"}},
                ],
            }
        )
        messages.append(
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": TOOL_RESULT}]}
        )
    return messages


def history_body(messages: list[dict]) -> bytes:
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "system": SYSTEM, "tools": TOOLS, "messages": messages}
    return orjson.dumps(body)


def next_turn(messages: list[dict], answer: str, step: int) -> None:
    messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    messages.append({"role": "user", "content": [{"type": "text", "text": f"Output of step {step}:\n" + TOOL_RESULT}]})


def parse_cpu_s(body: bytes, reps: int = 3) -> float:
    """CPU seconds of `orjson.loads(body)` (median of `reps`) on this thread."""
    samples = []
    for _ in range(reps):
        started = time.thread_time()
        orjson.loads(body)
        samples.append(time.thread_time() - started)
    return statistics.median(samples)


async def next_turn_costs(http, proxy: Child, engine: Child, key: str, messages: list[dict], answer: str, reps: int):
    """`reps` calls, each extending `messages` by `answer` and a tool result as a harness would, one at a time: per
    call the proxy's and the engine's process CPU, the wall time, the body's size and `orjson.loads` of it on the
    proxy's core. Returns those lists and the last body."""
    costs: dict[str, list[float]] = {"proxy_cpu": [], "engine_cpu": [], "wall": [], "sizes": [], "parse_cpu": []}
    body = b""
    for step in range(reps):
        next_turn(messages, answer, step)
        body = history_body(messages)
        await asyncio.sleep(0.05)  # let the proxy finish its bookkeeping of the previous call
        proxy_before, engine_before = cpu_s(proxy.pid), cpu_s(engine.pid)
        _, total, answer = await call_proxy(http, proxy.url, key, body, keep_text=True)
        await asyncio.sleep(0.05)
        costs["proxy_cpu"].append(cpu_s(proxy.pid) - proxy_before)
        costs["engine_cpu"].append(cpu_s(engine.pid) - engine_before)
        costs["wall"].append(total)
        costs["sizes"].append(len(body))
        _pin(PROXY_CORE)  # the floor on the proxy's core, while the proxy is idle
        costs["parse_cpu"].append(parse_cpu_s(body))
        _pin(ENGINE_CORE)
    return costs, body


async def long_history_path(http, engine: Child, proxy: Child, setup: dict, reps: int) -> dict:
    """Proxy process CPU per request at ~700K tokens vs parsing the body, measured on the proxy's core."""
    await set_pace(http, engine, 0.0)
    (key,) = await issue_keys(http, proxy, 1)
    messages = long_history(setup["template"], 700_000)
    proxy_before = cpu_s(proxy.pid)
    _, first_s, answer = await call_proxy(http, proxy.url, key, history_body(messages), keep_text=True)
    first_cpu = cpu_s(proxy.pid) - proxy_before
    costs, body = await next_turn_costs(http, proxy, engine, key, messages, answer, reps)
    tokens = await proxy_input_tokens(http, proxy.url, key, body)
    cpu_ms, parse_ms = statistics.median(costs["proxy_cpu"]) * 1e3, statistics.median(costs["parse_cpu"]) * 1e3
    return {
        "what": "next turn of a ~700K-token Anthropic history: proxy process CPU per request vs orjson.loads(body)",
        "history_tokens": tokens,
        "body_bytes": statistics.median(costs["sizes"]),
        "first_request_cpu_ms": round(first_cpu * 1e3, 1),
        "first_request_wall_ms": round(first_s * 1e3, 1),
        "proxy_cpu_ms_per_request": round(cpu_ms, 3),
        "proxy_cpu_ms_samples": [round(c * 1e3, 2) for c in costs["proxy_cpu"]],
        "json_parse_ms": round(parse_ms, 3),
        "cpu_over_parse": round(cpu_ms / parse_ms, 2),
        "call_wall_ms_p50": round(statistics.median(costs["wall"]) * 1e3, 1),
        "engine_endpoint_cpu_ms_per_request": round(statistics.median(costs["engine_cpu"]) * 1e3, 1),
        "target": "proxy_cpu_ms_per_request <= 3 x json_parse_ms",
        "met": cpu_ms <= 3 * parse_ms,
    }


async def proxy_input_tokens(http, url: str, key: str, body: bytes) -> int:
    """The prompt length the proxy reports for `body` (count_tokens route; a throwaway builder)."""
    obj = orjson.loads(body)
    obj.pop("stream"), obj.pop("max_tokens")
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01", "Content-Type": "application/json"}
    async with http.post(url + "/v1/messages/count_tokens", data=orjson.dumps(obj), headers=headers) as response:
        return (await response.json())["input_tokens"]


def breakdown(setup: dict, reps: int, history_tokens: int) -> dict:
    """The proxy's request path stage by stage, in this process (pinned to the proxy's core), engine stubbed.

    Mirrors `ProxyServer._dialect_handler`, `_Call._engine_request`, `generate_routed` (its per-attempt
    `dataclasses.replace`), `RemoteEngine.generate_stream` (wire encoding) and `_Call._record`; for reference also
    what the engine endpoint does with that body (`wire.loads` + `request_from_wire`).
    """
    from gyre.config.proxy import ProxyConfig
    from gyre.engine import wire
    from gyre.proxy import body_reuse
    from gyre.proxy.dialects import ANTHROPIC, anthropic
    from gyre.proxy.payload import PayloadCache
    from gyre.proxy.render import PromptBuilder
    from gyre.proxy.routing import RoutedFinish, RoutingTable
    from gyre.proxy.server import MAX_BODY_DEPTH, OFF_THE_LOOP_BODY_BYTES, ProxyServer, _Call
    from gyre.proxy.sessions import SessionRegistry, thread_key

    template = setup["template"]
    _pin(PROXY_CORE)
    with tempfile.TemporaryDirectory(prefix="gyre-proxy-overhead-") as records:
        registry = SessionRegistry(
            vocab_size=template.tokenizer.get_vocab_size(),
            make_builder=lambda payload: PromptBuilder(template, payload),
            make_payload_cache=PayloadCache,
            records_dir=records,
        )
        server = ProxyServer(
            ProxyConfig(model_names=[MODEL], context_limit=4_000_000),
            template=template,
            registry=registry,
            table=RoutingTable(),
            context_limit=4_000_000,
        )
        session = registry.issue()
        headers = {"anthropic-version": "2023-06-01", "x-api-key": session.key}
        output_ids = setup["token_ids"][:4]
        messages = long_history(template, history_tokens)
        stages: dict[str, list[float]] = {}

        def timed(name: str, fn):
            started = time.thread_time()  # CPU time: other work on the shared cores does not count
            value = fn()
            stages.setdefault(name, []).append(time.thread_time() - started)
            return value

        answer = ""
        for step in range(reps + 1):
            if step:
                next_turn(messages, answer, step)
            raw = history_body(messages)
            timed("reference: json_parse of the whole body", lambda raw=raw: orjson.loads(raw))
            cache = session.parse_cache(f"anthropic:{thread_key(headers)}")

            def decode(raw=raw, cache=cache):  # as ProxyServer._admit: only what the thread's last body lacks
                previous = cache.body
                reused = body_reuse.reuse(raw, previous, MAX_BODY_DEPTH, OFF_THE_LOOP_BODY_BYTES) if previous else None
                if reused is not None:
                    return reused
                body = orjson.loads(raw)
                return body, body_reuse.fresh(raw, body, "messages")

            obj, layout = timed("body_decode", decode)
            request = timed(
                "dialect_parse", lambda obj=obj, cache=cache: anthropic.parse_request(obj, headers, {}, cache=cache)
            )
            cache.body = layout
            builder = session.builder(thread_key(request.signals))
            prompt = timed("prompt_build", lambda request=request, builder=builder: builder.build(request))
            params = timed(
                "sampling_params", lambda request=request, prompt=prompt: server._sampling(request, prompt.num_tokens)
            )
            call = _Call(server, ANTHROPIC, session, request, prompt, params)
            timed("prompt_input_ids_concat", lambda prompt=prompt: prompt.input_ids)
            sub = timed("generate_request_validation", call._engine_request)  # routing sends it as is
            encoded = timed(
                "engine_request_encode",
                lambda sub=sub: wire.generate_to_frame(sub, stream=True, submission_id=uuid.uuid4().hex),
            )
            timed("engine_side_decode (engine endpoint)", lambda e=encoded: wire.generate_from_frame(e))

            def output(call=call):
                call.finish = None
                call.output_ids = list(output_ids)
                call.logprobs = [-1.0] * len(output_ids)
                call.versions = [0]
                writer = call._writer()
                data = writer.start() + b"".join(writer.event(e) for e in call.decoder.feed(output_ids))
                events, call.output = call.decoder.finish("length")
                data += b"".join(writer.event(e) for e in events)
                call.finish = RoutedFinish("length", 0, ("stub",), 0.0, 0.0)
                return data + writer.finish(call.output, call._usage())

            timed("output_decode_and_sse", output)
            timed("record_and_payload_cache", call._record)
            answer = call.output.text
    _pin(ENGINE_CORE)
    skip = 1  # the first request is a fresh build of the whole history
    medians = {name: statistics.median(values[skip:]) * 1e3 for name, values in stages.items()}
    proxy_stages = {k: v for k, v in medians.items() if not k.startswith(("engine_side", "reference"))}
    parse = medians["reference: json_parse of the whole body"]
    return {
        "what": "median CPU ms per stage of the proxy's request path (in-process, proxy core, engine stubbed)",
        "history_tokens": prompt.num_tokens,
        "stages_ms": {name: round(v, 3) for name, v in medians.items()},
        "proxy_stages_sum_ms": round(sum(proxy_stages.values()), 3),
        "sum_over_json_parse": round(sum(proxy_stages.values()) / parse, 2),
        "first_request_stages_ms": {name: round(values[0] * 1e3, 1) for name, values in stages.items()},
    }


# ============================================================================ main


def plain_text_ids(template) -> list[int]:
    """Ids whose single-token decode is a word (no whitespace-only, no markup), so deltas stream at once."""
    text = " the quick brown fox jumps over the lazy dog and then returns to the start of the line"
    ids = []
    for token in template.encode(text):
        piece = template.tokenizer.decode([token])
        if piece.strip() and piece.strip().isalpha() and token not in ids:
            ids.append(token)
    return ids


def prepare(template) -> dict:
    from gyre.proxy.dialects import anthropic
    from gyre.proxy.render import PromptBuilder

    token_ids = plain_text_ids(template)
    conversation = Conversation([], [], 8)
    request = anthropic.parse_request(orjson.loads(conversation.proxy_body()), {"anthropic-version": "x"}, {})
    base_ids = list(PromptBuilder(template).build(request).input_ids)
    turn = "\n<|im_start|>user\nOutput of step 1: tests still fail.<|im_end|>\n<|im_start|>assistant\n"
    return {"template": template, "token_ids": token_ids, "base_ids": base_ids, "turn_ids": template.encode(turn)}


async def run(args, setup: dict, engine: Child, proxy: Child, passthrough: Child) -> dict:
    quick = args.quick
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=CALL_TIMEOUT) as http:
        started = time.perf_counter()
        a = await one_session(http, engine, proxy, setup, calls=40 if quick else 400, warmup=5 if quick else 40)
        c = await saturation(http, engine, proxy, passthrough, setup, duration_s=1.5 if quick else 8.0)
        b = await agents(
            http,
            engine,
            proxy,
            setup,
            sessions=64 if quick else 512,
            duration_s=3.0 if quick else 45.0,
            saturation_rps=c["proxy_requests_per_s"],
        )
        d = await long_history_path(http, engine, proxy, setup, reps=1 if quick else 12)
    d["breakdown"] = breakdown(setup, reps=1 if quick else 12, history_tokens=700_000)
    c["breakdown_small_request"] = breakdown(setup, reps=2 if quick else 30, history_tokens=2_000)
    return {
        "a_one_session": a,
        "b_agent_sessions": b,
        "c_saturation": c,
        "d_long_history_cpu": d,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run (~30 s on 2 cores): each section, too few samples to mean much",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--role", choices=("engine", "proxy", "passthrough"), help=argparse.SUPPRESS)
    parser.add_argument("--core", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--engine-url", default="", help=argparse.SUPPRESS)
    parser.add_argument("--token-ids", default="", help=argparse.SUPPRESS)
    parser.add_argument("--token-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        child_main(args)
        return

    from gyre.models.tiny import tiny_model_dir
    from gyre.proxy.render import ChatTemplate

    setup = prepare(ChatTemplate.from_pretrained(tiny_model_dir()))
    _pin(ENGINE_CORE)
    children: list[Child] = []
    with tempfile.TemporaryDirectory(prefix="gyre-proxy-overhead-logs-") as logs:
        try:
            token_ids = ",".join(map(str, setup["token_ids"]))
            engine = Child("engine", ENGINE_CORE, Path(logs), "--token-ids", token_ids)
            children.append(engine)
            proxy = Child("proxy", PROXY_CORE, Path(logs), "--engine-url", engine.url)
            children.append(proxy)
            passthrough = Child("passthrough", PROXY_CORE, Path(logs), "--engine-url", engine.url)
            children.append(passthrough)
            result = asyncio.run(run(args, setup, engine, proxy, passthrough))
        except BaseException:
            for child in children:
                with contextlib.suppress(OSError):
                    sys.stderr.write(f"--- {child.role} log tail ---\n")
                    child.log.flush()
                    sys.stderr.write(Path(child.log.name).read_text(errors="replace")[-3000:])
            raise
        finally:
            for child in reversed(children):
                child.stop()
    summary = {
        "a_added_p50_ms": result["a_one_session"]["added_p50_ms"],
        "b_added_p50_ms": result["b_agent_sessions"]["added_p50_ms"],
        "b_added_p99_ms": result["b_agent_sessions"]["added_p99_ms"],
        "c_throughput_ratio": result["c_saturation"]["throughput_ratio"],
        "d_cpu_over_parse": result["d_long_history_cpu"]["cpu_over_parse"],
        "met": {
            "a": result["a_one_session"]["met"],
            "b": result["b_agent_sessions"]["met"],
            "c": result["c_saturation"]["met"],
            "d": result["d_long_history_cpu"]["met"],
        },
    }
    emit(
        {
            "benchmark": "proxy_overhead",
            "mode": "quick" if args.quick else "full",
            "event_loop": "uvloop" if _has_uvloop() else "asyncio",
            "pinning": {"engine": ENGINE_CORE, "load_generator": ENGINE_CORE, "proxy_and_passthrough": PROXY_CORE},
            "summary": summary,
            **result,
        },
        args.out,
    )


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
