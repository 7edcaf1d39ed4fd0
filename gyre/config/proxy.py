"""Config of the black-box proxy (`gyre.proxy`) and of `python -m gyre.serve` (proxy + embedded engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre.config.checks import (
    is_int,
    require,
    require_bool,
    require_choice,
    require_duration,
    require_int,
    require_number,
)

# SGLang's names of the output parsers gyre implements (`gyre.proxy.parsers.registry`, which a unit test keeps equal;
# the config imports nothing of the proxy).
TOOL_CALL_PARSER_NAMES = ("hermes", "qwen25", "qwen", "qwen3_coder", "llama3")
REASONING_PARSER_NAMES = ("qwen3", "qwen3-thinking", "deepseek-r1", "none")
THINKING_MODES = ("template", "enabled", "disabled", "client")


@dataclass(kw_only=True)
class SamplingConfig:
    """How the policy samples during rollouts. The framework decides, not the harness (see `honor_client`)."""

    temperature: float = 1.0
    """Behavior temperature; RL rollouts should sample (> 0). 0 = greedy."""
    top_p: float = 1.0
    """Nucleus filter, 1 = off."""
    top_k: int = 0
    """Top-k filter, 0 = off."""
    max_new_tokens: int = 2048
    """Cap on output tokens per call; a client's smaller max_tokens wins."""
    honor_client: bool = False
    """Use the client's temperature/top_p/top_k when it sends them. Off by default: the behavior policy of a
    training run must not depend on what a harness happens to request."""
    seed: int | None = None
    """None: calls sample from the engine's global RNG. An integer: each call is seeded with
    `gyre.engine.protocol.call_seed(seed, execution, prompt ids)`, so a run's calls sample the same tokens when
    repeated on the same weights, whatever else the engine batches (docs/engine.md, "Seeded sampling")."""

    def __post_init__(self) -> None:
        require_number("sampling.temperature", self.temperature, ge=0)
        require_number("sampling.top_p", self.top_p, gt=0, le=1)
        require_int("sampling.top_k", self.top_k, ge=0, note="0 = off")
        require_int("sampling.max_new_tokens", self.max_new_tokens, ge=1)
        require_bool("sampling.honor_client", self.honor_client)
        require(
            self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63),
            "sampling.seed",
            self.seed,
            "null (unseeded) or an integer in [0, 2**63)",
        )


@dataclass(kw_only=True)
class ProxyConfig:
    host: str = "127.0.0.1"
    """Address the proxy binds. Keep 127.0.0.1 unless harnesses run on other machines."""
    port: int = 0
    """0 picks a free port (printed at start)."""
    model_names: list[str] = field(default_factory=lambda: ["gyre"])
    """Model names clients may ask for; any other is a 404 in the dialect's shape. The first is reported."""
    context_limit: int = 0
    """Prompt + output tokens allowed per call; 0 = the model's max_position_embeddings. A longer prompt gets the
    API's 400 "prompt is too long", which is what makes Claude Code compact."""
    min_output_tokens: int = 1
    """A prompt must leave at least this many tokens of output room, or it is too long."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Request bodies above this get 413 in the dialect's shape."""
    shards: int = 0
    """Processes that serve the model calls (`python -m gyre.train` only): 0 = the controller's own event loop
    (one thread); N = N proxy shards on the controller's node, each serving the executions placed on it, while the
    controller keeps every decision (docs/proxy.md, "Shards"). One shard costs ~100 MB and a core at full load;
    one thread serves ~180 calls/s of 100K-token histories on these machines (benchmarks/proxy_scale.py)."""
    engine_wait_s: float = 600.0
    """How long a call waits for an accepting engine (all engines draining) before failing with 503/529."""
    gc_freeze_every: int = 16
    """Every this many calls, move the heap into the garbage collector's permanent generation (0 = never).
    Execution trees and histories live for hours; a full collection rescans them all and paused the proxy for
    80-230 ms in benchmarks/proxy_overhead.py (b), and at 256 the young collections still took up to 17 ms.
    Freezing is O(1); frozen objects are still freed by reference counting."""
    gc_full_every_s: float = 600.0
    """Unfreeze and run one full collection this often, so cyclic garbage frozen earlier is reclaimed (0 = never)."""
    shutdown_grace_s: float = 1.0
    """At shutdown (SIGTERM), how long calls in flight may still finish before they are aborted (and recorded with
    what they sampled) and the remaining connections, slow ones included, are closed."""
    request_head_timeout_s: float = 75.0
    """A connection must deliver a complete request head (request line and headers) within this long of opening or
    of its last answer, else it is closed; this also closes idle keep-alive connections (aiohttp's
    `keepalive_timeout`, nginx's default). A client trickling its headers cannot hold a connection longer."""
    body_timeout_s: float = 120.0
    """A request's whole body must arrive within this long of its head, else 408 in the dialect's shape and nothing
    is recorded (64 MiB at 10 MB/s takes 7 s)."""
    stream_keepalive_s: float = 10.0
    """A streamed call with no first token this long after it was admitted (a long prefill: ~48K tokens on a CPU
    take minutes) starts its stream and gets the dialect's keep-alive this often until its first tokens (Anthropic
    `ping` events, an SSE comment for OpenAI), so a harness's idle-connection timers do not end it; an engine
    failure after that is the dialect's in-stream error event instead of an HTTP error. 0: nothing is sent before
    the first tokens. docs/proxy.md, "Long prefills"."""
    tool_call_parser: str = "hermes"
    """How the model writes tool calls, by SGLang's `--tool-call-parser` name: hermes (= qwen25, qwen: Qwen2.5, Qwen3,
    gyre's tiny model), qwen3_coder (Qwen3-Coder's XML-like tags), llama3 (Llama 3.x JSON). docs/proxy.md,
    "Tool-call and reasoning parsers"."""
    reasoning_parser: str | None = "qwen3"
    """How the model marks its reasoning, by SGLang's `--reasoning-parser` name: qwen3 (`<think>...</think>` when the
    output opens it), qwen3-thinking and deepseek-r1 (the output starts inside thinking); none or null: no split,
    all output is text."""
    record_routed_experts: bool = False
    """Ask the engines for the experts each token was routed to (a mixture-of-experts model) and record them with
    each call, for routing replay in training (`python -m gyre.train` sets it with `trainer.routing_replay`); costs
    num_hidden_layers x top_k x 2 bytes per token in the tree, 4/3 of that in the record file (base64; docs/moe.md,
    "Routing replay")."""
    thinking: str = "template"
    """Whether calls think, for chat templates that read Qwen3's `enable_thinking`: template (pass nothing: the
    template's default), enabled / disabled (every call), client (the request's own switch: Anthropic `thinking`,
    OpenAI `reasoning_effort`). Only the final generation prompt changes; docs/proxy.md, "Thinking in the history"."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def enable_thinking(self, client_asked: bool) -> bool | None:
        """The `enable_thinking` a call's template gets (None: not passed), given what the client asked for."""
        return {"template": None, "enabled": True, "disabled": False}.get(self.thinking, client_asked)

    def __post_init__(self) -> None:
        require_choice("proxy.thinking", self.thinking, THINKING_MODES)
        require_bool("proxy.record_routed_experts", self.record_routed_experts)
        require_choice(
            "proxy.tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSER_NAMES, note="SGLang's parser names"
        )
        require(
            self.reasoning_parser is None or self.reasoning_parser in REASONING_PARSER_NAMES,
            "proxy.reasoning_parser",
            self.reasoning_parser,
            f"null or one of {', '.join(REASONING_PARSER_NAMES)} (SGLang's parser names)",
        )
        require_int("proxy.port", self.port, ge=0, le=65535, note="0 = any free port")
        require_duration("proxy.shutdown_grace_s", self.shutdown_grace_s, allow_zero=True)
        require_duration("proxy.request_head_timeout_s", self.request_head_timeout_s)
        require_duration("proxy.body_timeout_s", self.body_timeout_s)
        require_duration("proxy.stream_keepalive_s", self.stream_keepalive_s, allow_zero=True, note="0 = off")
        require(
            len(self.model_names) >= 1 and all(isinstance(n, str) and n for n in self.model_names),
            "proxy.model_names",
            self.model_names,
            "a non-empty list of non-empty names",
        )
        require_int("proxy.context_limit", self.context_limit, ge=0, note="0 = model's")
        require_int("proxy.min_output_tokens", self.min_output_tokens, ge=1)
        require_int("proxy.shards", self.shards, ge=0, le=256, note="0 = the controller's loop")
        require_int("proxy.max_body_bytes", self.max_body_bytes, ge=1024)
        require_duration("proxy.engine_wait_s", self.engine_wait_s, allow_zero=True)
        require_int("proxy.gc_freeze_every", self.gc_freeze_every, ge=0, note="0 = off")
        require_duration("proxy.gc_full_every_s", self.gc_full_every_s, allow_zero=True, note="0 = off")
