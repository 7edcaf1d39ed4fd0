"""The errors of the engine endpoint's wire format and its HTTP client, importable with the stdlib alone.

`gyre.engine.wire` (which imports torch for its tensor frames) raises and maps them, `gyre.engine.remote` raises
them on the client side, and the proxy catches `RemoteEngineError` without loading torch. The errors any engine
raises (`EngineUnavailableError`, `EngineBusyError`, and `ValueError` for a bad request) are the protocol's, in
`gyre.engine.protocol`. See `docs/engine.md`.
"""


class WireError(ValueError):
    """A message that does not follow the wire format (a client or server bug, or a foreign peer)."""


class PromptBaseUnknown(LookupError):
    """A `/generate` frame extends a base prompt the endpoint does not hold (evicted, or another call of the same
    execution came in between): the client sends the whole prompt instead."""


class RemoteEngineError(RuntimeError):
    """The endpoint failed in a way the protocol does not name (HTTP 500 or a foreign status)."""


class EngineAuthError(RemoteEngineError):
    """The endpoint refused the call: it requires the job's secret and the call carried none (HTTP 401) or another
    one (HTTP 403). A configuration error of the caller, not a failure of the engine."""
