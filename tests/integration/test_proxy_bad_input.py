"""Bad input over real HTTP: the dialect's 4xx shape with a clear message, nothing recorded, the server goes on.

The serving stack (proxy + one native engine on the tiny model) runs on its own thread and event loop; the test
talks to it with plain `http.client`, as a foreign client would. A hypothesis fuzz test posts arbitrary JSON and
mutated valid bodies to every route: never a 5xx, never a dead server.
"""

from __future__ import annotations

import http.client
import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxy_stack import StackThread, hang_up_mid_call, held_stack

from gyre.config import EngineConfig, ServeConfig
from gyre.config.proxy import ProxyConfig, SamplingConfig
from gyre.traj.store import load_tree

BODY_CAP = 64 * 1024
VALID_PATH = "/v1/messages"
ROUTES = ("/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions", "/v1/responses")
VALID = {
    "/v1/messages": {"model": "gyre", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": "gyre", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/chat/completions": {"model": "gyre", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "gyre", "max_output_tokens": 4, "input": "hi"},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    records = tmp_path_factory.mktemp("records")
    cfg = ServeConfig(
        engine=EngineConfig(max_running=4),
        proxy=ProxyConfig(max_body_bytes=BODY_CAP, context_limit=1024, sampling=SamplingConfig(max_new_tokens=4)),
        executions=0,
    )
    stack = StackThread(cfg, records)
    yield stack
    stack.stop()


def error_message(path: str, reply: dict) -> str:
    """The message of the dialect's error shape (and check the shape)."""
    if path.startswith("/v1/messages"):
        assert reply["type"] == "error" and set(reply["error"]) >= {"type", "message"}
    else:
        assert set(reply["error"]) >= {"message", "type", "param", "code"}
    return reply["error"]["message"]


def calls_recorded(served) -> int:
    return len(load_tree(served.stack.registry.records_dir / "fuzz.jsonl").calls)


@pytest.mark.parametrize("path", ROUTES)
def test_bad_requests_get_the_dialects_4xx_and_record_nothing(served, path):
    before = calls_recorded(served)
    valid = VALID[path]
    cases = [
        (b"{not json", 400, "not valid JSON"),
        (b'{"model": "gyre", "messages": "\xff\xfe"}', 400, "not valid JSON"),  # invalid UTF-8
        (json.dumps({**valid, "model": 7}).encode(), 400, "model"),
        (json.dumps({k: v for k, v in valid.items() if k != "model"}).encode(), 400, "model"),
        (json.dumps({**valid, "model": "gpt-9"}).encode(), 404, "gpt-9"),
        (json.dumps({**valid, "pad": "x" * BODY_CAP}).encode(), 413, "exceeds the limit"),
        (json.dumps([valid]).encode(), 400, ""),
    ]
    for body, status, match in cases:
        code, reply = served.post(path, body)
        assert code == status, (body[:60], reply)
        assert match in error_message(path, reply)
    code, reply = served.post(path, json.dumps(valid).encode(), key="gyre-wrong")
    assert code == 401 and error_message(path, reply)
    code, reply = served.post(path, json.dumps(valid).encode())  # the server keeps serving
    assert code == 200, reply
    recorded = 0 if path.endswith("count_tokens") else 1
    assert calls_recorded(served) == before + recorded  # only the valid call


@pytest.mark.parametrize("path", [p for p in ROUTES if not p.endswith("count_tokens")])
def test_an_unknown_gyre_role_is_a_400_and_a_known_one_is_recorded(served, path):
    before = calls_recorded(served)
    body = json.dumps(VALID[path]).encode()
    code, reply = served.post(path, body, headers={"x-gyre-role": "boss"})
    assert code == 400 and "x-gyre-role" in error_message(path, reply)
    assert calls_recorded(served) == before
    code, reply = served.post(path, body, headers={"x-gyre-role": "main-summary"})
    assert code == 200, reply
    last = max(load_tree(served.stack.registry.records_dir / "fuzz.jsonl").calls, key=lambda call: call.index)
    assert last.meta.role_signals["gyre_role"] == "main-summary"


THREAD_DIALECTS = {  # path: (history field, a user item, an assistant item, the rest of the body)
    "/v1/messages": (
        "messages",
        lambda text: {"role": "user", "content": [{"type": "text", "text": text}]},
        lambda text: {"role": "assistant", "content": [{"type": "text", "text": text}]},
        {"model": "gyre", "max_tokens": 2},
    ),
    "/v1/responses": (  # Codex: `input` items
        "input",
        lambda text: {"type": "message", "role": "user", "content": text},
        lambda text: {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]},
        {"model": "gyre", "max_output_tokens": 2},
    ),
}


@pytest.mark.parametrize("path", sorted(THREAD_DIALECTS))
def test_a_threads_bodies_are_served_as_if_each_were_decoded_whole_however_they_change(served, path):
    """The server decodes only what a body adds to its thread's previous one (gyre.proxy.body_reuse). Whatever the
    next body does (extends the history, adds a second history key after the array, which JSON decoding takes,
    edits an early item), each call's prompt is the one a fresh execution gets for the same bytes."""
    field, u, a, rest = THREAD_DIALECTS[path]
    name = f"reuse-{field}"
    thread = served.stack.registry.issue(name)

    def raw(items):
        return json.dumps({**rest, field: items}).encode()

    history = [u("hi"), a("zq answer one"), u("more")]
    injected = raw(history)[:-1] + json.dumps({field: [u("injected")]}).encode().replace(b"{", b", ", 1)
    bodies = [
        raw(history[:1]),
        raw(history),
        raw([*history, a("zq answer two"), u("again")]),  # extended: reused
        injected,  # the same bytes first, then a key that wins
        raw([*history, a("zq answer two"), u("again"), a("zq three"), u("last")]),
        raw([u("hi, edited"), *history[1:]]),
    ]
    assert json.loads(injected)[field] == [u("injected")]
    for i, body in enumerate(bodies):
        code, reply = served.post(path, body, key=thread.key)
        assert code == 200, reply
        fresh = served.stack.registry.issue(f"{name}-fresh-{i}")
        code, reply = served.post(path, body, key=fresh.key)
        assert code == 200, reply
        threaded = load_tree(served.stack.registry.records_dir / f"{name}.jsonl")
        alone = load_tree(served.stack.registry.records_dir / f"{name}-fresh-{i}.jsonl")
        assert threaded.call_tokens(i)[0] == alone.call_tokens(0)[0], f"body {i}"


def test_count_tokens_refuses_an_unknown_gyre_role_as_the_model_call_routes_do(served):
    body = json.dumps(VALID["/v1/messages/count_tokens"]).encode()
    code, reply = served.post("/v1/messages/count_tokens", body, headers={"x-gyre-role": "boss"})
    assert code == 400 and "x-gyre-role" in error_message("/v1/messages/count_tokens", reply)
    assert served.post("/v1/messages/count_tokens", body, headers={"x-gyre-role": "sub-agent"})[0] == 200


def test_a_tool_result_that_answers_no_call_is_a_400(served):
    body = {
        "model": "gyre",
        "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_nobody", "content": "x"}]},
        ],
    }
    code, reply = served.post("/v1/messages", json.dumps(body).encode())
    assert code == 400 and "toolu_nobody" in error_message("/v1/messages", reply)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=20,
)


@st.composite
def bodies(draw):
    path = draw(st.sampled_from(ROUTES))
    if draw(st.booleans()):
        return path, draw(json_values)
    body = json.loads(json.dumps(VALID[path]))  # a valid body with one field replaced or added
    key = draw(st.sampled_from([*body, "messages", "tools", "system", "input", "stream", "temperature"]))
    body[key] = draw(st.booleans() if key == "stream" else json_values)
    return path, body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=bodies())
def test_fuzzed_bodies_never_get_a_5xx(served, case):
    path, body = case
    code, reply = served.post(path, json.dumps(body).encode())
    assert code < 500, (path, body, reply)
    if code >= 400:
        assert error_message(path, reply)


FUZZ_BODIES = 1000
HUGE = [2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30, -1, 0, -0.0, 1e308, -1e308, 1.5]
HOSTILE_TEXT = ["", "a\n", "\x00", "\x1c\x1f", "con", "../../etc/passwd", "\u2028", "x" * 5000, "%s%n", "\ufeff"]


def fuzz_value(rng, depth: int = 0):
    """A random JSON value: huge and odd numbers, hostile strings, nested containers."""
    kind = rng.randrange(7 if depth < 6 else 4)
    if kind == 0:
        return rng.choice(HUGE)
    if kind == 1:
        return rng.choice(HOSTILE_TEXT)
    if kind == 2:
        return rng.choice([None, True, False])
    if kind == 3:
        return rng.randint(-(2**70), 2**70)
    if kind == 4:
        return [fuzz_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["role", "content", "type", "text", "x", ""]): fuzz_value(rng, depth + 1) for _ in range(3)}


def fuzz_case(rng) -> tuple[str, bytes, dict]:
    """One hostile request: a route, its raw body and extra headers."""
    path = rng.choice(ROUTES)
    headers: dict = {}
    kind = rng.randrange(6)
    if kind == 0:  # any JSON at all
        return path, json.dumps(fuzz_value(rng)).encode(), headers
    body = json.loads(json.dumps(VALID[path]))
    if kind == 1:  # one field of a valid body replaced or added
        field = rng.choice([*body, "messages", "tools", "system", "input", "stream", "temperature", "top_k", "top_p"])
        body[field] = fuzz_value(rng)
    elif kind == 2:  # huge or odd integers where counts go
        body[rng.choice(["max_tokens", "max_output_tokens", "max_completion_tokens", "top_k", "n"])] = rng.choice(HUGE)
    elif kind == 3:  # nested deep, around the limit
        return path, with_nested(body, rng.choice(["metadata", "tools", "messages"]), rng.randrange(90, 300)), headers
    elif kind == 4:  # broken bytes: truncated JSON, invalid UTF-8, lone surrogates, NaN
        raw = json.dumps(body).encode()
        broken = [raw[: rng.randrange(len(raw))], raw.replace(b"hi", b"\xff\xfe"), raw.replace(b"hi", b"\\ud800")]
        return path, rng.choice([*broken, raw.replace(b"4", b"NaN")]), headers
    else:  # hostile role headers on a valid body
        # (a NUL or newline in a header is refused by aiohttp's HTTP parser in plain text, before gyre sees it)
        role = rng.choice(["boss", "", "main x", "MAIN", "sub-agent", "main-summary"])
        headers = {"x-gyre-role": role, "x-gyre-agent-id": rng.choice(["a/../b", "", "x" * 300])}
    return path, json.dumps(body).encode(), headers


def test_fuzzed_requests_never_get_a_5xx_never_record_a_refused_call_and_leave_the_key_working(served):
    """>= 1,000 generated bodies over the four routes: 0 answers >= 500, nothing recorded for an answer that is not 2xx,
    and the same key answers a valid call after each (its token count; every tenth body a recorded generation of the
    body's route, ~11 ms each on the tiny model: the generations were 60% of this test). At the end the record file
    holds exactly the calls of the tree."""
    import random

    rng = random.Random(1213)
    tree = served.session.tree
    count_tokens = "/v1/messages/count_tokens"
    for index in range(FUZZ_BODIES):
        path, raw, headers = fuzz_case(rng)
        before = len(tree.calls)
        code, reply = served.post(path, raw, headers=headers)
        assert code < 500, (path, raw[:300], headers, reply)
        if not 200 <= code < 300:
            assert len(tree.calls) == before, (path, raw[:300], reply)
            assert error_message(path, reply)
        before = len(tree.calls)
        code, reply = served.post(count_tokens, json.dumps(VALID[count_tokens]).encode())
        assert code == 200 and reply["input_tokens"] > 0 and len(tree.calls) == before, (path, raw[:300], reply)
        if index % 10 == 9 or index == FUZZ_BODIES - 1:
            valid = "/v1/messages" if path == count_tokens else path
            code, reply = served.post(valid, json.dumps(VALID[valid]).encode())
            assert code == 200 and len(tree.calls) == before + 1, (path, raw[:300], reply)
    assert len(load_tree(served.stack.registry.records_dir / "fuzz.jsonl").calls) == len(tree.calls)


def with_nested(body: dict, field: str, depth: int) -> bytes:
    """`body` with `field` set to {"request_kind": [[...[1]...]]} `depth` arrays deep (written as text: the stdlib
    encoder recurses)."""
    text = json.dumps({**body, field: {"request_kind": "NESTED"}})
    return text.replace('"NESTED"', "[" * depth + "1" + "]" * depth).encode()


@pytest.mark.parametrize(
    ("path", "field", "depth"),
    [
        ("/v1/responses", "client_metadata", 985),  # finding 1: broke the execution for good
        ("/v1/responses", "metadata", 260),  # finding 3: a 500 after recording
        ("/v1/messages", "metadata", 1000),  # finding 4: 200, then a 500 (the message cache's comparison)
        ("/v1/chat/completions", "metadata", 1000),
        ("/v1/messages/count_tokens", "metadata", 200),
    ],
)
def test_a_body_nested_too_deep_is_a_400_before_anything_and_the_execution_goes_on(served, path, field, depth):
    before = calls_recorded(served)
    body = with_nested(VALID[path], field, depth)
    for _ in range(2):  # the same body twice: the same answer
        code, reply = served.post(path, body)
        assert code == 400 and "levels deep" in error_message(path, reply), reply
    assert calls_recorded(served) == before
    code, reply = served.post(path, json.dumps(VALID[path]).encode())
    assert code == 200, reply
    recorded = 0 if path.endswith("count_tokens") else 1
    assert calls_recorded(served) == before + recorded
    fine = with_nested(VALID[path], field, 100)  # deep but allowed: served
    assert served.post(path, fine)[0] == 200


def admin_post(served, path: str, body: bytes) -> tuple[int, dict]:
    connection = http.client.HTTPConnection(served.host, served.port, timeout=60)
    headers = {"content-type": "application/json", "authorization": f"Bearer {served.stack.proxy.admin_key}"}
    connection.request("POST", path, body=body, headers=headers)
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, json.loads(data)


@pytest.mark.parametrize("body", [b"[1,2]", b"5", b"null", b'"x"', b'{"execution": "a\\n"}', b'{"execution": "con"}'])
def test_an_admin_body_that_is_not_an_object_or_names_a_bad_id_issues_no_key(served, body):
    open_before = set(served.stack.registry._by_execution)
    status, answer = admin_post(served, "/gyre/executions", body)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error", answer
    assert set(served.stack.registry._by_execution) == open_before


def test_a_closed_execution_id_is_refused_with_409_and_its_file_is_untouched(served):
    status, issued = admin_post(served, "/gyre/executions", b'{"execution": "reuse-1"}')
    assert status == 200
    assert served.post(VALID_PATH, json.dumps(VALID[VALID_PATH]).encode(), key=issued["key"])[0] == 200
    assert admin_post(served, "/gyre/executions/reuse-1/close", b"")[0] == 200
    record_file = served.stack.registry.records_dir / "reuse-1.jsonl"
    closed_bytes = record_file.read_bytes()
    status, answer = admin_post(served, "/gyre/executions", b'{"execution": "reuse-1"}')
    assert status == 409 and answer["error"]["type"] == "conflict_error" and "closed" in answer["error"]["message"]
    assert served.post(VALID_PATH, json.dumps(VALID[VALID_PATH]).encode(), key=issued["key"])[0] == 401
    assert record_file.read_bytes() == closed_bytes


def test_a_prompt_the_engine_refuses_is_a_400_before_any_stream_starts(tmp_path):
    """The proxy's context limit set above the engine's, and a KV budget (`engine.max_total_tokens`) below it: the
    engine's refusals reach the client as a 400 that names what to change."""
    cfg = ServeConfig(
        engine=EngineConfig(max_total_tokens=512),
        proxy=ProxyConfig(context_limit=100_000, sampling=SamplingConfig(max_new_tokens=4)),
        executions=0,
    )
    stack = StackThread(cfg, tmp_path / "records")
    try:
        beyond_context = "word " * 6000  # beyond the tiny model's 4096 positions
        beyond_budget = "word " * 600  # within them, beyond 512 tokens of KV
        for text, says in ((beyond_context, "engine refused"), (beyond_budget, "engine.max_total_tokens")):
            for stream in (False, True):
                body = {
                    "model": "gyre",
                    "max_tokens": 4,
                    "stream": stream,
                    "messages": [{"role": "user", "content": text}],
                }
                code, reply = stack.post("/v1/messages", json.dumps(body).encode())
                assert code == 400 and says in error_message("/v1/messages", reply), reply
        assert calls_recorded(stack) == 0
    finally:
        stack.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_harness_that_hangs_up_mid_call_aborts_it_and_what_was_sampled_is_recorded_once(tmp_path, stream):
    """The engine (the stand-in) holds the call after its first token, so the hang-up always comes mid-call."""
    cfg = ServeConfig(proxy=ProxyConfig(sampling=SamplingConfig(max_new_tokens=3000)), executions=0)
    stack = held_stack(cfg, tmp_path / "records")
    try:
        body = {"model": "gyre", "max_tokens": 3000, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
        records = stack.stack.registry.records_dir / "fuzz.jsonl"

        def recorded() -> list:
            return load_tree(records).calls if records.exists() else []

        hang_up_mid_call(stack, body, stream)
        for _ in range(200):  # bounded: the proxy records the aborted call after its engine stream ends
            if recorded():
                break
            threading.Event().wait(0.05)
        (aborted,) = recorded()  # recorded once
        assert aborted.response.finish_reason == "abort"
        assert 0 < len(aborted.response.ids) < 3000
    finally:
        stack.stop()
