"""Config of the black-box proxy (`gyre.proxy`) and of `python -m gyre.serve` (proxy + embedded engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre.config.checks import require


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

    def __post_init__(self) -> None:
        require(self.temperature >= 0, "sampling.temperature", self.temperature, "a number >= 0")
        require(0 < self.top_p <= 1, "sampling.top_p", self.top_p, "a number in (0, 1]")
        require(self.top_k >= 0, "sampling.top_k", self.top_k, "an integer >= 0 (0 = off)")
        require(self.max_new_tokens >= 1, "sampling.max_new_tokens", self.max_new_tokens, "an integer >= 1")


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
    engine_wait_s: float = 600.0
    """How long a call waits for an accepting engine (all engines draining) before failing with 503/529."""
    gc_freeze_every: int = 16
    """Every this many calls, move the heap into the garbage collector's permanent generation (0 = never).
    Execution trees and histories live for hours; a full collection rescans them all and paused the proxy for
    80-230 ms in benchmarks/proxy_overhead.py (b), and at 256 the young collections still took up to 17 ms.
    Freezing is O(1); frozen objects are still freed by reference counting."""
    gc_full_every_s: float = 600.0
    """Unfreeze and run one full collection this often, so cyclic garbage frozen earlier is reclaimed (0 = never)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        require(0 <= self.port <= 65535, "proxy.port", self.port, "an integer in [0, 65535] (0 = any free port)")
        require(
            len(self.model_names) >= 1 and all(isinstance(n, str) and n for n in self.model_names),
            "proxy.model_names",
            self.model_names,
            "a non-empty list of non-empty names",
        )
        require(self.context_limit >= 0, "proxy.context_limit", self.context_limit, "an integer >= 0 (0 = model's)")
        require(self.min_output_tokens >= 1, "proxy.min_output_tokens", self.min_output_tokens, "an integer >= 1")
        require(self.max_body_bytes >= 1024, "proxy.max_body_bytes", self.max_body_bytes, "an integer >= 1024")
        require(self.engine_wait_s >= 0, "proxy.engine_wait_s", self.engine_wait_s, "a number >= 0")
        require(self.gc_freeze_every >= 0, "proxy.gc_freeze_every", self.gc_freeze_every, "an integer >= 0 (0 = off)")
        require(self.gc_full_every_s >= 0, "proxy.gc_full_every_s", self.gc_full_every_s, "a number >= 0 (0 = off)")
