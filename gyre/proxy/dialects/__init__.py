"""API dialects: Anthropic Messages, OpenAI Chat Completions, OpenAI Responses (pure: JSON in, JSON/SSE out).

`DIALECTS` are the dialects the proxy serves, each one object implementing `gyre.proxy.dialects.protocol.Dialect`;
they check fields with one kit (`gyre.proxy.dialects.fields`). docs/proxy.md says how to add one.
"""

from gyre.proxy.dialects.anthropic import ANTHROPIC
from gyre.proxy.dialects.openai_chat import OPENAI_CHAT
from gyre.proxy.dialects.openai_responses import OPENAI_RESPONSES
from gyre.proxy.dialects.protocol import Dialect

# In this order `GET /v1/models` asks them whether a listing is theirs (`Dialect.lists_models_for`).
DIALECTS: tuple[Dialect, ...] = (ANTHROPIC, OPENAI_CHAT, OPENAI_RESPONSES)
DIALECTS_BY_NAME: dict[str, Dialect] = {dialect.name: dialect for dialect in DIALECTS}

__all__ = ["ANTHROPIC", "DIALECTS", "DIALECTS_BY_NAME", "OPENAI_CHAT", "OPENAI_RESPONSES", "Dialect"]
