"""The errors of the engine endpoint's wire format and its HTTP client, importable with the stdlib alone.

`gyre.engine.wire` (which imports torch for its tensor frames) raises and maps them, `gyre.engine.remote` raises
them on the client side, and the proxy catches `RemoteEngineError` without loading torch. The errors any engine
raises (`EngineUnavailableError`, `EngineBusyError`, and `ValueError` for a bad request) are the protocol's, in
`gyre.engine.protocol`. `EngineUnreachable` is the one of them a client raises when it cannot talk to the endpoint
at all (a subclass of `EngineUnavailableError`, so whoever only routes around a refusal routes around it too).
See `docs/engine.md`.
"""

from gyre.engine.protocol import EngineUnavailableError


class WireError(ValueError):
    """A message that does not follow the wire format (a client or server bug, or a foreign peer)."""


class PromptBaseUnknown(LookupError):
    """A `/generate` frame extends a base prompt the endpoint does not hold (evicted, or another call of the same
    execution came in between): the client sends the whole prompt instead."""


class RemoteEngineError(RuntimeError):
    """The endpoint failed in a way the protocol does not name (HTTP 500 or a foreign status)."""


class EngineUnreachable(EngineUnavailableError):
    """The endpoint cannot be reached or broke off mid-answer: connection refused or reset, a stream cut before its
    final chunk, no answer to a connect. The engine is alive only if a later request is answered (the proxy probes
    `/load` once before it counts the engine lost: docs/proxy.md "An engine that dies"). Unlike a plain
    `EngineUnavailableError` (an endpoint that answered "not now": draining, memory released), nothing was heard
    from the engine; what it streamed before is all the client has of that request."""


class EngineAuthError(RemoteEngineError):
    """The endpoint refused the call: it requires the job's secret and the call carried none (HTTP 401) or another
    one (HTTP 403). A configuration error of the caller, not a failure of the engine."""
