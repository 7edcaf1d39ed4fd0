"""The proxy's limits over real HTTP: output budget, slow clients (issue 13, findings 7 and 10).

- A client's `max_tokens` far beyond anything (2^63, u64 max) is clamped to the output cap and the context room,
  never refused and never generated past: Claude Code asks for 32,000 whatever the model (docs/proxy.md, "One call").
- A connection that trickles its request head is closed after `proxy.request_head_timeout_s`; a body that trickles
  gets a 408 in the dialect's shape after `proxy.body_timeout_s`, nothing is recorded and the key goes on working.
"""

from __future__ import annotations

import gc
import json
import socket
import time
from pathlib import Path

import pytest
from proxy_stack import StackThread

from gyre.config import ServeConfig
from gyre.config.proxy import ProxyConfig, SamplingConfig
from gyre.proxy.dialects.anthropic import parse_count_tokens
from gyre.proxy.token_estimate import SAMPLE_CHARS
from gyre.traj.store import load_tree

CAP = 6  # sampling.max_new_tokens
HEAD_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
HUGE = (2**63, 2**64 - 1)
BUDGET_FIELD = {
    "/v1/messages": "max_tokens",
    "/v1/chat/completions": "max_tokens",
    "/v1/responses": "max_output_tokens",
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cfg = ServeConfig(
        proxy=ProxyConfig(
            sampling=SamplingConfig(max_new_tokens=CAP, temperature=0.0),
            request_head_timeout_s=HEAD_TIMEOUT_S,
            body_timeout_s=BODY_TIMEOUT_S,
        ),
        executions=0,
    )
    stack = StackThread(cfg, tmp_path_factory.mktemp("records"))
    yield stack
    stack.stop()


def calls(served) -> list:
    return load_tree(served.stack.registry.records_dir / "fuzz.jsonl").calls


def body_for(path: str, max_tokens: int, stream: bool, text: str) -> bytes:
    body = {"model": "gyre", BUDGET_FIELD[path]: max_tokens, "stream": stream}
    body |= {"input": text} if path == "/v1/responses" else {"messages": [{"role": "user", "content": text}]}
    return json.dumps(body).encode()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", sorted(BUDGET_FIELD))
def test_a_huge_max_tokens_is_clamped_to_the_output_cap(served, path, stream):
    """Each call ends at the cap (finish "length") or before it, on its own end of turn: never past it."""
    for max_tokens in HUGE:
        before = len(calls(served))
        started = time.monotonic()
        status, _ = served.post(path, body_for(path, max_tokens, stream, f"count {max_tokens} {path} {stream}"))
        elapsed = time.monotonic() - started
        assert status == 200, (path, max_tokens)
        recorded = calls(served)
        assert len(recorded) == before + 1
        output = recorded[-1].response
        assert len(output.ids) <= CAP and (len(output.ids) == CAP) == (output.finish_reason == "length"), output
        assert elapsed < 30, f"{elapsed:.1f} s for at most {CAP} tokens"


def test_beyond_u64_max_tokens_is_a_400_naming_the_field(served):
    raw = b'{"model":"gyre","max_tokens":18446744073709551616,"messages":[{"role":"user","content":"hi"}]}'
    status, reply = served.post("/v1/messages", raw)
    assert status == 400 and reply["error"]["message"].startswith("max_tokens:"), reply


def request_head(key: str, body: bytes) -> bytes:
    """The request line and headers of a `/v1/messages` call whose body is `body` (sent by the test as it likes)."""
    return (
        "POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"x-api-key: {key}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()


def raw_connection(served) -> socket.socket:
    connection = socket.create_connection((served.host, served.port), timeout=10)
    connection.settimeout(10)
    return connection


def closed_within(connection: socket.socket, deadline_s: float, trickle: bytes = b"") -> float | None:
    """Send `trickle` a byte every 0.1 s until the server closes; the seconds that took, None if it never did."""
    started = time.monotonic()
    connection.settimeout(0.1)
    sent = 0
    while time.monotonic() - started < deadline_s:
        try:
            if connection.recv(65536) == b"":
                return time.monotonic() - started
        except TimeoutError:
            pass
        except ConnectionResetError:
            return time.monotonic() - started
        try:
            connection.sendall(trickle[sent % len(trickle) : sent % len(trickle) + 1] if trickle else b"")
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started
        sent += 1
    return None


def test_a_client_trickling_its_request_head_is_disconnected(served):
    connection = raw_connection(served)
    try:
        connection.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n")
        took = closed_within(connection, 10 * HEAD_TIMEOUT_S, trickle=b"X-Slow: aaaaaaaaaaaaaaaa")
    finally:
        connection.close()
    assert took is not None and took < 3 * HEAD_TIMEOUT_S + 1, took


def test_an_idle_connection_is_closed_and_a_fresh_one_is_served(served):
    connection = raw_connection(served)
    try:
        took = closed_within(connection, 10 * HEAD_TIMEOUT_S)
    finally:
        connection.close()
    assert took is not None and took < 3 * HEAD_TIMEOUT_S + 1, took
    assert served.post("/v1/messages", body_for("/v1/messages", 2, False, "after idle"))[0] == 200


def test_a_trickling_body_gets_a_408_records_nothing_and_the_key_goes_on(served):
    before = len(calls(served))
    body = body_for("/v1/messages", 2, False, "slow body")
    head = request_head(served.session.key, body)
    connection = raw_connection(served)
    try:
        connection.sendall(head + body[:5])
        started = time.monotonic()
        answer = b""
        connection.settimeout(0.1)
        for byte in body[5:-1]:  # never the last byte: the body stays incomplete
            try:
                chunk = connection.recv(65536)
            except TimeoutError:
                chunk = None
            if chunk == b"":
                break
            answer += chunk or b""
            if time.monotonic() - started > 10 * BODY_TIMEOUT_S:
                break
            try:
                connection.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
        elapsed = time.monotonic() - started
    finally:
        connection.close()
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), answer[:200]
    reply = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert reply["error"]["type"] == "timeout_error" and "body_timeout_s" in reply["error"]["message"], reply
    assert elapsed < 3 * BODY_TIMEOUT_S + 1, elapsed
    assert len(calls(served)) == before
    assert served.post("/v1/messages", body_for("/v1/messages", 2, False, "after the slow body"))[0] == 200


# ----------------------------------------------------------------------------- big prompts (finding 8)

COUNT = "/v1/messages/count_tokens"
BIG_TEXT = "lorem ipsum dolor sit amet " * 400_000  # 10.8 MB, ~2 M tokens: far beyond the tiny model's 4,096


def big_body(path: str, text: str, *, stream: bool = False) -> bytes:
    return (
        body_for(path, 4, stream, text)
        if path != COUNT
        else json.dumps({"model": "gyre", "messages": [{"role": "user", "content": text}]}).encode()
    )


@pytest.fixture
def encoded_lengths(served, monkeypatch):
    """The length of every text the proxy's template encodes during the test."""
    template = served.stack.proxy.template
    lengths: list[int] = []
    encode, encode_many = template.encode, template.encode_many

    def counting(text: str) -> list[int]:
        lengths.append(len(text))
        return encode(text)

    def counting_many(texts: list[str]) -> list[list[int]]:
        lengths.extend(map(len, texts))
        return encode_many(texts)

    monkeypatch.setattr(template, "encode", counting)
    monkeypatch.setattr(template, "encode_many", counting_many)
    return lengths


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", sorted(BUDGET_FIELD))
def test_a_10_mb_prompt_is_refused_before_it_is_tokenized(served, encoded_lengths, path, stream):
    before = len(calls(served))
    started = time.monotonic()
    status, reply = served.post(path, big_body(path, BIG_TEXT, stream=stream))
    elapsed = time.monotonic() - started
    assert status == 400, reply
    message = reply["error"]["message"]
    assert message.startswith("prompt is too long: ") and "tokens > 4095 maximum" in message, message
    assert max(encoded_lengths, default=0) < 100_000, "the big text was tokenized"
    assert elapsed < 30
    assert len(calls(served)) == before
    assert served.post(path, body_for(path, 2, stream, "after the big one"))[0] == 200


def test_a_prompt_whose_floor_fits_is_counted_exactly_and_refused_with_its_count(served):
    digits = "7" * 40_000  # one token a digit: floor 2,500 (fits), count 40,000 (does not)
    status, reply = served.post("/v1/messages", big_body("/v1/messages", digits))
    assert status == 400 and reply["error"]["message"].startswith("prompt is too long: "), reply
    at_least = int(reply["error"]["message"].split(": ", 1)[1].split()[0])
    assert 4095 < at_least <= 40_100


def rss_mb() -> float:
    """This process's resident memory (the stack serves in it), in MB."""
    gc.collect()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_a_10_mb_count_is_estimated_from_a_bounded_sample(served, encoded_lengths):
    """count_tokens of a prompt far past the context limit answers an estimate (marked so) from at most
    SAMPLE_CHARS encoded characters, within 2% of the exact count, holding no memory for it (docs/proxy.md,
    "Counting tokens"); before, it tokenized them all (a 10 MB text: 10.25 s, +1.1 GB)."""
    exact = len(served.stack.proxy.template.encode("lorem ipsum dolor sit amet " * 4_000)) * 100
    encoded_lengths.clear()
    before_mb = rss_mb()
    started = time.monotonic()
    status, reply = served.post(COUNT, big_body(COUNT, BIG_TEXT))
    elapsed = time.monotonic() - started
    assert status == 200 and served.last_headers["gyre-token-count"] == "estimate", reply
    assert abs(reply["input_tokens"] - exact) <= 0.02 * exact, (reply, exact)
    assert sum(encoded_lengths) <= SAMPLE_CHARS, "more than the sample was tokenized"
    assert rss_mb() - before_mb < 100
    assert elapsed < 30


def test_a_count_within_the_limit_is_exact_and_one_past_it_is_at_least_its_count(served):
    text = "seven " * 500
    status, reply = served.post(COUNT, big_body(COUNT, text))
    assert status == 200 and served.last_headers["gyre-token-count"] == "exact"
    request = parse_count_tokens(json.loads(big_body(COUNT, text)), {}, {})
    thinking = served.stack.proxy.config.enable_thinking(request.thinking)
    builder = served.session.make_builder(served.session.payload)
    assert reply["input_tokens"] == builder.build(request, enable_thinking=thinking).num_tokens
    digits = "7" * 20_000  # one token a digit, within the characters counted exactly: counted, past the limit
    status, reply = served.post(COUNT, big_body(COUNT, digits))
    assert status == 200 and served.last_headers["gyre-token-count"] == "estimate"
    assert 20_000 <= reply["input_tokens"] <= 20_100, reply


def test_a_call_whose_execution_closes_while_its_body_is_read_is_refused_and_not_recorded(served):
    """The key is checked when the head arrives; an admin close during the body read must still refuse the call
    (401, nothing recorded, the closed file untouched), never record into a closed execution."""
    session = served.stack.registry.issue("closes-mid-body")
    body = body_for("/v1/messages", 2, False, "closed while you were typing")
    head = request_head(session.key, body)
    connection = raw_connection(served)
    try:
        connection.sendall(head + body[:10])
        time.sleep(0.3)  # the handler has authenticated and is reading the body

        async def close() -> int:  # on the stack's loop, which owns the registry
            return served.stack.registry.close("closes-mid-body")

        served.call(close())
        records = served.stack.registry.records_dir / "closes-mid-body.jsonl"
        closed_bytes = records.read_bytes()
        connection.sendall(body[10:])
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < 20:
            chunk = connection.recv(65536)
            if not chunk:
                break
            answer += chunk
    finally:
        connection.close()
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert records.read_bytes() == closed_bytes
    assert load_tree(records).calls == []
