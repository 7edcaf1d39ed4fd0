"""A real Claude Code session's prompts on the CPU engine: the long first prefill, and later calls paying only their
new tokens through the prefix cache (docs/proxy.md, "Long prefills").

Two parts in one run:
1. **The session, recorded.** The real Claude Code CLI (`-p`, the task on stdin, as the claude_code runner starts
   it) against gyre's proxy on 127.0.0.1, the engine a `ScriptedEngine` (a stand-in, named as such: it is what
   makes the session go on) answering in the model's own tool-call format: call 1 runs `Bash ls`, call 2 reads
   `README.md`, call 3 says it is done. The proxy builds every prompt with TITO (docs/proxy.md), the engine keeps
   each call's `input_ids`. Per call: its prompt tokens, and how many of them extend the previous call's prompt and
   output exactly (the longest common prefix: what a prefix cache can reuse).
2. **The same prompts on the native engine** (the repo recipe's CPU model: the tiny model, 1 layer, 131,072
   positions, random init, fp32), one execution, in order, one output token each (greedy): the time to the first
   token and the engine's `cached_tokens` (KV reused from the execution's previous call).

Reported: per call, prompt / reusable / cached / new tokens and the first token's time; the later calls' share of
prompt tokens served from the prefix cache; the first call's prefill rate. Needs the Claude Code CLI (PATH, the
npm test cache of tests/integration/test_harness_clis.py, or `--claude PATH`), else it says so and exits 2.

    python benchmarks/session_prefill.py [--claude PATH] [--out benchmarks/results/session_prefill.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from report import emit

STEPS = (  # what the scripted engine answers to call 1, 2, 3 (Claude Code's tool names)
    '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls", "description": "List files"}}\n</tool_call>',
    '<tool_call>\n{"name": "Read", "arguments": {"file_path": "{workspace}/README.md"}}\n</tool_call>',
    "The README says hello. Done.",
)
TASK = "List the files here, read README.md, then say you are done."
CLI_TIMEOUT_S = 300


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def record_session(claude: str, model_dir: Path, workspace: Path) -> list[tuple[list[int], list[int]]]:
    """Run Claude Code once through the proxy; each call's (input ids, output ids) in order."""
    from gyre.config import EngineConfig, ProxyConfig, ServeConfig
    from gyre.config.proxy import SamplingConfig
    from gyre.engine.endpoint import ServerThread
    from gyre.engine.scripted import ScriptedEngine, chat_reply
    from gyre.proxy.render import ChatTemplate
    from gyre.serve.stack import build_stack

    template = ChatTemplate.from_pretrained(model_dir)
    replies: list[list[int]] = []

    def respond(request, prompt: str) -> str:
        text = STEPS[min(len(replies), len(STEPS) - 1)].replace("{workspace}", str(workspace))
        replies.append([*template.encode(text), template.end_of_turn_ids[0]])
        return text

    thread = ServerThread(lambda: ScriptedEngine(chat_reply(template, respond), record_requests=True))
    url = thread.start()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    cfg = ServeConfig(
        model_dir=str(model_dir),
        engine=EngineConfig(enabled=False),
        engine_urls=[url],
        proxy=ProxyConfig(sampling=SamplingConfig(max_new_tokens=256)),
        executions=0,
    )
    stack = asyncio.run_coroutine_threadsafe(build_stack(cfg, records_dir=None), loop).result(120)
    session = stack.registry.issue("session")
    home_dir = tempfile.TemporaryDirectory(prefix="gyre-bench-home-")  # the CLI's private HOME, removed after
    home = Path(home_dir.name)
    env = {
        "PATH": f"{os.path.dirname(claude)}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": stack.proxy.url,
        "ANTHROPIC_API_KEY": session.key,
        "IS_SANDBOX": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "ANTHROPIC_MODEL": "gyre",
        "ANTHROPIC_SMALL_FAST_MODEL": "gyre",
    }
    try:
        done = subprocess.run(
            [claude, "-p", "--dangerously-skip-permissions"],
            input=TASK,
            cwd=workspace,
            env=env,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise SystemExit(f"session_prefill: Claude Code exited {done.returncode}: {done.stdout[-500:]}")
        requests = thread.call(lambda engine: list(engine.requests))
    finally:
        asyncio.run_coroutine_threadsafe(stack.close(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.stop()
        home_dir.cleanup()
    return [(list(r.input_ids), out) for r, out in zip(requests, replies, strict=True)]


async def replay(model_dir: Path, calls: list[tuple[list[int], list[int]]]) -> list[dict]:
    """Each call's prompt on the native engine, in order, as one execution: first-token time and cached tokens."""
    import torch

    from gyre.engine.native import NativeEngine
    from gyre.engine.protocol import GenerateRequest, SamplingParams
    from gyre.models.hf_weights import load_pretrained

    torch.set_num_threads(os.cpu_count() or 1)
    engine = NativeEngine(load_pretrained(model_dir), max_running=1)
    out = []
    for index, (input_ids, _) in enumerate(calls):
        request = GenerateRequest(
            request_id=f"call-{index}",
            execution_id="session",
            input_ids=tuple(input_ids),
            params=SamplingParams(temperature=0.0, max_new_tokens=1),
        )
        start = time.perf_counter()
        result = await engine.generate(request)
        wall = time.perf_counter() - start
        cached = result.cached_tokens
        out.append(
            {
                "cached_tokens": cached,
                "new_tokens": len(input_ids) - cached,
                "first_token_s": round(result.timings.first_token_s, 2),
                "wall_s": round(wall, 2),
            }
        )
    return out


def find_claude(given: str | None) -> str | None:
    from gyre.harness.runners.claude_code import CLAUDE_CODE_PACKAGE, CLAUDE_CODE_VERSION, find_cli

    return find_cli(given, "claude", CLAUDE_CODE_PACKAGE, CLAUDE_CODE_VERSION)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claude", default=None, help="the claude CLI (default: PATH, then the npm test cache)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    claude = find_claude(args.claude)
    if claude is None:
        print("session_prefill: the Claude Code CLI is not installed (pass --claude PATH)", file=sys.stderr)
        raise SystemExit(2)
    from gyre.config.model import TinyModelSpec
    from gyre.models.tiny import tiny_model_dir

    spec = TinyModelSpec(num_hidden_layers=1, max_position_embeddings=131072)  # conf/recipe/repo.yaml's model
    model_dir = tiny_model_dir(spec=spec, ends_turns=True)
    with tempfile.TemporaryDirectory(prefix="gyre-bench-ws-") as workspace:
        (Path(workspace) / "README.md").write_text("hello\n")
        calls = record_session(claude, model_dir, Path(workspace))
    native = asyncio.run(replay(model_dir, calls))
    rows = []
    previous: list[int] = []
    for (input_ids, output_ids), engine in zip(calls, native, strict=True):
        rows.append({"prompt_tokens": len(input_ids), "reusable_tokens": common_prefix(previous, input_ids), **engine})
        previous = input_ids + output_ids
    later = rows[1:]
    prompt_later = sum(r["prompt_tokens"] for r in later)
    version = subprocess.run([claude, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
    result = {
        "benchmark": "session_prefill",
        "harness": f"Claude Code {version}",
        "model": "tiny, 1 layer, 131,072 positions, random init, fp32 (conf/recipe/repo.yaml)",
        "calls": rows,
        "first_call_prefill_tokens_per_s": round(rows[0]["prompt_tokens"] / rows[0]["first_token_s"]),
        "later_calls_cached_share": round(sum(r["cached_tokens"] for r in later) / prompt_later, 4) if later else None,
        "later_calls_reusable_share": round(sum(r["reusable_tokens"] for r in later) / prompt_later, 4)
        if later
        else None,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
