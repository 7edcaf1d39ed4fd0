"""The real Claude Code and Codex CLIs, offline, against `python -m gyre.serve`: each runs a task to exit 0 and
the proxy records its main-agent requests.

Setup (session-scoped, each step bounded by a timeout):
- The CLIs are installed with npm, at pinned versions (those of docs/harness.md), into
  `$GYRE_TEST_CLI_CACHE` (default `~/.cache/gyre-test-clis`)/`<package>@<version>`, once per machine. No npm
  or node, or a failed install: the tests skip with npm's error in the reason.
- The served model is the tiny model with one layer (the default has four) and two changes, built into a temp dir:
  * `max_position_embeddings=131072`: Claude Code's first request is ~48K tokens in the tiny tokenizer (its
    system prompt and 24 tools), Codex's ~23K; at the default 4096 the proxy answers 400 "prompt is too long".
    Positions past training mean nothing to a random-init model, nor do any others.
  * an embedding edit that makes it end its turn (emit `<|im_end|>`) with probability ~0.2 per token. A
    random-init model almost never does (~1/512), so every answer stopped at the output cap, and both CLIs
    treat a capped answer as a failure (Claude Code retries 3 times, then exits 1 with "exceeded the 32000
    output token maximum"; Codex exits 1 with "Incomplete response returned, reason: max_output_tokens").
- One server with two executions: exec-00000 for Claude Code, exec-00001 for Codex. Stopped by PID.

Time on 2 CPU cores: ~9 s for Claude Code (the 48K-token prefill dominates: ~60 s with the default four layers),
~3 s for Codex, ~5 s for the npm installs when npm's cache is warm. GYRE_SKIP_HARNESS_TESTS=1 skips them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_process import Served, start_serve

pytestmark = [
    pytest.mark.harness,
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("GYRE_SKIP_HARNESS_TESTS") == "1", reason="GYRE_SKIP_HARNESS_TESTS=1"),
]

CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.197", "claude")  # (package, version, bin)
CODEX = ("@openai/codex", "0.171.0", "codex")
NPM_INSTALL_TIMEOUT_S = 300
SERVE_READY_TIMEOUT_S = 120
CLI_TIMEOUT_S = 300
INSPECT_TIMEOUT_S = 60
CONTEXT_LIMIT = 131072
MAX_NEW_TOKENS = 48  # each answer is short; with the turn-ending edit most end far earlier
MODEL_NAME = "gyre"
TASK = "Create a file named hello.txt that contains the word hi."
TAIL_CHARS = 3000


def _tail(text: str | bytes | None, chars: int = TAIL_CHARS) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text[-chars:]


def _cli_cache_root() -> Path:
    env = os.environ.get("GYRE_TEST_CLI_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gyre-test-clis"


def _install_cli(package: str, version: str, bin_name: str) -> Path:
    """The CLI's executable, installed with npm on first use (staging dir, then a rename); skips if impossible."""
    missing = [tool for tool in ("npm", "node") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not on PATH: cannot install {package}@{version}")
    target = _cli_cache_root() / f"{package.replace('/', '__')}@{version}"
    executable = target / "node_modules" / ".bin" / bin_name
    if executable.exists():
        return executable
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".staging-{os.getpid()}-{target.name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    command = ["npm", "install", "--prefix", str(staging), "--no-audit", "--no-fund", "--no-save", "--loglevel=error"]
    try:
        proc = subprocess.run(
            [*command, f"{package}@{version}"],
            cwd=staging,
            capture_output=True,
            text=True,
            timeout=NPM_INSTALL_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        shutil.rmtree(staging, ignore_errors=True)
        pytest.skip(f"npm install {package}@{version} timed out after {NPM_INSTALL_TIMEOUT_S} s: {_tail(exc.stderr)}")
    if proc.returncode != 0 or not (staging / "node_modules" / ".bin" / bin_name).exists():
        shutil.rmtree(staging, ignore_errors=True)
        output = _tail(proc.stderr + proc.stdout)
        pytest.skip(f"npm install {package}@{version} failed (exit {proc.returncode}): {output}")
    try:
        staging.rename(target)
    except OSError:  # another session installed it first
        shutil.rmtree(staging, ignore_errors=True)
    assert executable.exists(), executable
    return executable


@pytest.fixture(scope="session")
def claude_bin() -> Path:
    return _install_cli(*CLAUDE_CODE)


@pytest.fixture(scope="session")
def codex_bin() -> Path:
    return _install_cli(*CODEX)


@pytest.fixture(scope="session")
def long_context_model(tmp_path_factory) -> Path:
    from gyre.config import TinyModelSpec
    from gyre.models.tiny import bias_toward_end_of_turn, build_tiny_model
    from gyre.models.tokenizer import load_tokenizer
    from gyre.proxy.render import ChatTemplate

    # One layer, not the default four: the CLIs' 48K-token prefill is attention-bound, so it costs a quarter, and a
    # random-init model means no more with four layers than with one (what is tested is the CLI and the proxy).
    spec = TinyModelSpec(max_position_embeddings=CONTEXT_LIMIT, num_hidden_layers=1)
    model_dir = build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-long", spec=spec)
    # Qwen3's own 128K recipe (YaRN x4 over 32,768 positions): the CLIs' ~48K-token prompts run past the original
    # window, so gyre.serve loads and serves a YaRN model here.
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32_768}
    (model_dir / "config.json").write_text(json.dumps(config))
    (end_of_turn_id,) = ChatTemplate.from_pretrained(model_dir).end_of_turn_ids
    assert load_tokenizer(model_dir).id_to_token(end_of_turn_id) == "<|im_end|>"
    bias_toward_end_of_turn(model_dir)
    return model_dir


@pytest.fixture(scope="session")
def served(long_context_model: Path, tmp_path_factory):
    """`python -m gyre.serve` on the long-context model, two executions; stopped by PID at the end."""
    overrides = [
        f"model_dir={long_context_model}",
        f"proxy.sampling.max_new_tokens={MAX_NEW_TOKENS}",
        f"proxy.model_names=[{MODEL_NAME}]",
        "engine.max_running=2",
        "executions=2",
    ]
    server = start_serve(tmp_path_factory.mktemp("serve") / "run", *overrides, timeout_s=SERVE_READY_TIMEOUT_S)
    try:
        yield server
    finally:
        server.stop()


def records(served: Served, execution: str) -> Path:
    return served.records / f"{execution}.jsonl"


def log_tail(served: Served) -> str:
    log = served.run_dir / "serve.log"
    return _tail(log.read_text(errors="replace")) if log.exists() else "(no serve.log)"


def _cli_env(home: Path, **extra: str) -> dict[str, str]:
    """A clean environment: no user's API keys, proxies or CLI config leak in; HOME is a temp dir."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8"}
    env.update(extra)
    return env


def _run_cli(argv: list[str], *, cwd: Path, env: dict[str, str], served: Served) -> subprocess.CompletedProcess:
    started = time.monotonic()
    try:
        proc = subprocess.run(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"{Path(argv[0]).name} did not exit within {CLI_TIMEOUT_S} s\nstdout: {_tail(exc.stdout)}\n"
            f"stderr: {_tail(exc.stderr)}\nserve.log: {log_tail(served)}"
        )
    print(f"{Path(argv[0]).name}: exit {proc.returncode} after {time.monotonic() - started:.1f} s")
    assert proc.returncode == 0, (
        f"{Path(argv[0]).name} exited {proc.returncode}\nstdout: {_tail(proc.stdout)}\nstderr: {_tail(proc.stderr)}\n"
        f"serve.log: {log_tail(served)}"
    )
    return proc


def _inspect(records: Path, harness: str) -> dict:
    assert records.exists(), f"no record file {records}"
    proc = subprocess.run(
        [sys.executable, "-m", "gyre.traj.inspect", "--harness", harness, str(records)],
        capture_output=True,
        text=True,
        timeout=INSPECT_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    print(f"{harness}: {json.dumps(summary['total'])}")
    return summary["total"]


def _record_calls(records: Path) -> list[dict]:
    calls = [json.loads(line) for line in records.read_text().splitlines()]
    return [call for call in calls if call.get("kind") == "call"]


def _prompt_tokens(call: dict) -> int:
    return sum(len(segment.get("ids", ())) for segment in call["segments"])


def test_claude_code_runs_a_task_and_its_main_agent_is_recorded(claude_bin: Path, served: Served, tmp_path):
    execution = "exec-00000"
    workspace, home = tmp_path / "workspace", tmp_path / "home"
    workspace.mkdir()
    home.mkdir()
    env = _cli_env(
        home,
        ANTHROPIC_BASE_URL=served.anthropic_url,
        ANTHROPIC_API_KEY=served.keys[execution],
        ANTHROPIC_MODEL=MODEL_NAME,
        ANTHROPIC_SMALL_FAST_MODEL=MODEL_NAME,
        IS_SANDBOX="1",  # as root, --dangerously-skip-permissions is refused without it
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",  # no telemetry, update checks or title request
    )
    _run_cli([str(claude_bin), "-p", TASK, "--dangerously-skip-permissions"], cwd=workspace, env=env, served=served)

    record_file = records(served, execution)
    total = _inspect(record_file, "claude_code")
    assert total["requests"] >= 1
    assert total["leaves_by_role"]["main"] >= 1, total
    calls = _record_calls(record_file)
    first_signals = calls[0]["role_signals"]
    assert first_signals.get("user-agent", "").startswith("claude-cli/"), first_signals
    assert _prompt_tokens(calls[0]) > 4096  # its system prompt and tools: why the model needs a long context


def test_codex_runs_a_task_and_its_main_agent_is_recorded(codex_bin: Path, served: Served, tmp_path):
    execution = "exec-00001"
    workspace, home, codex_home = tmp_path / "workspace", tmp_path / "home", tmp_path / "codex-home"
    for path in (workspace, home, codex_home):
        path.mkdir()
    (codex_home / "config.toml").write_text(
        f'model = "{MODEL_NAME}"\n'
        'model_provider = "gyre"\n'
        "\n"
        "[model_providers.gyre]\n"
        'name = "gyre"\n'
        f'base_url = "{served.openai_url}"\n'
        'env_key = "GYRE_API_KEY"\n'
        'wire_api = "responses"\n'
    )
    env = _cli_env(home, CODEX_HOME=str(codex_home), GYRE_API_KEY=served.keys[execution])
    argv = [
        str(codex_bin),
        "exec",
        "--skip-git-repo-check",
        "-c",
        "analytics.enabled=false",
        "-c",
        "check_for_update_on_startup=false",
        "--disable",
        "plugins",
        TASK,
    ]
    _run_cli(argv, cwd=workspace, env=env, served=served)

    record_file = records(served, execution)
    total = _inspect(record_file, "codex")
    assert total["requests"] >= 1
    assert total["leaves_by_role"]["main"] >= 1, total
    calls = _record_calls(record_file)
    assert calls[0]["role_signals"].get("request_kind") == "turn", calls[0]["role_signals"]
    assert _prompt_tokens(calls[0]) > 4096
