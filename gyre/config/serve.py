"""Root config of `python -m gyre.serve`: the proxy plus an embedded native engine (and/or external engines)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre.config.checks import require, require_duration, require_int
from gyre.config.engine import EngineConfig
from gyre.config.proxy import ProxyConfig


@dataclass(kw_only=True)
class ServeConfig:
    """Root config of `python -m gyre.serve` (conf/serve.yaml)."""

    model_dir: str = ""
    """HF-layout model directory (config.json, safetensors, tokenizer.json, tokenizer_config.json with a chat
    template). Empty: the tiny default model, built locally on first use."""
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    engine_urls: list[str] = field(default_factory=list)
    """External engine endpoints (`python -m gyre.engine serve`) to route to as well, e.g. a separate pool."""
    executions: int = 1
    """Execution keys issued at start (more on request: POST /gyre/executions with the admin key)."""
    duration_s: float = 0.0
    """Stop after this many seconds; 0 = serve until SIGINT/SIGTERM."""

    def __post_init__(self) -> None:
        require_int("executions", self.executions, ge=0)
        require_duration("duration_s", self.duration_s, allow_zero=True, note="0 = until a signal")
        require(
            self.engine.backend == "native",
            "engine.backend",
            self.engine.backend,
            "native (gyre.serve embeds gyre's engine; SGLang runs in python -m gyre.train's cells)",
        )
        require(
            self.proxy.shards == 0,
            "proxy.shards",
            self.proxy.shards,
            "0 (gyre.serve serves every call on its own loop; proxy shards are python -m gyre.train's)",
        )
        require(
            self.engine.enabled or len(self.engine_urls) > 0,
            "engine.enabled",
            self.engine.enabled,
            "true unless engine_urls names at least one external engine",
        )
        for url in self.engine_urls:
            require(
                isinstance(url, str) and url.startswith(("http://", "https://")),
                "engine_urls",
                url,
                "http(s) URLs of engine endpoints",
            )
