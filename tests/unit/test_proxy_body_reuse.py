"""Decoding a body with the items it shares with the thread's previous one (gyre.proxy.body_reuse) gives exactly what
decoding it whole gives, and reuses only where that is certain."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.proxy import body_reuse

DEPTH = 128
NEW = 1 << 20  # new bytes a reuse takes on


def message(i: int, text: str = "") -> dict:
    return {"role": "user" if i % 2 == 0 else "assistant", "content": [{"type": "text", "text": f"m{i} {text}"}]}


def encode(body: dict, style: str = "compact") -> bytes:
    """As a harness would write it: compact (JS's JSON.stringify) or spaced (Python's json.dumps)."""
    separators = (",", ":") if style == "compact" else (", ", ": ")
    return json.dumps(body, ensure_ascii=False, separators=separators).encode()


def first(raw: bytes) -> body_reuse.Layout:
    layout = body_reuse.fresh(raw, orjson.loads(raw), "messages")
    assert layout is not None
    return layout


def test_an_extended_history_decodes_only_its_new_items_and_takes_the_old_ones_as_they_were():
    messages = [message(i) for i in range(5)]
    previous = first(encode({"model": "m", "messages": messages, "max_tokens": 4}))
    raw = encode({"model": "m", "messages": [*messages, message(5), message(6)], "max_tokens": 4})
    body, layout = body_reuse.reuse(raw, previous, DEPTH, NEW)
    assert body == orjson.loads(raw)
    assert all(a is b for a, b in zip(body["messages"][:5], previous.items, strict=True))  # the same objects
    assert (
        layout.ends == body_reuse.layout_of(raw, "messages")[1]
        and layout.close == body_reuse.layout_of(raw, "messages")[2]
    )
    assert layout.items is body["messages"]


def test_a_changed_last_item_is_decoded_again_and_a_changed_early_one_shares_only_what_precedes_it():
    messages = [message(i) for i in range(8)]
    previous = first(encode({"model": "m", "messages": messages}))
    moved = [*messages[:7], {**messages[7], "cache_control": {"type": "ephemeral"}}, message(8)]  # Claude Code
    assert previous.shared_items(encode({"model": "m", "messages": moved})) == 7
    edited = [*messages[:3], message(3, "edited"), *messages[4:]]
    raw = encode({"model": "m", "messages": edited})
    assert previous.shared_items(raw) == 3
    body, _ = body_reuse.reuse(raw, previous, DEPTH, NEW)
    assert body == orjson.loads(raw)
    assert previous.shared_items(encode({"model": "other", "messages": messages})) == 0  # the head changed


@pytest.mark.parametrize(
    ("tail", "why"),
    [
        (b',"messages":[0,{"role":"user","content":"injected"}]}', "a second messages key after the array wins"),
        (b',"m\\u0065ssages":[0]}', "a key written with escapes decodes to messages"),
    ],
)
def test_a_body_whose_tail_could_change_what_messages_decodes_to_is_decoded_whole(tail, why):
    messages = [message(i) for i in range(3)]
    previous = first(encode({"model": "m", "messages": messages}))
    raw = encode({"model": "m", "messages": [*messages, message(3)]})[:-1] + tail
    assert body_reuse.reuse(raw, previous, DEPTH, NEW) is None, why
    assert body_reuse.fresh(raw, orjson.loads(raw), "messages") is None  # and it is never the base of the next body


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","messages":[1,{"role":"user","content":"x"}]}',  # a number: its end is not scanned
        b'{"model":"m","messages":[{"role":"user","content":"x"},null]}',
        b'{"model":"m","messages":[true]}',
        b'{"model":"m","messages":{"0":{"role":"user"}}}',  # not an array
        b'{"model":"m","messages":[{"role":"user"}],"messages":[{"role":"user"}]}',  # twice
        b'{"model":"m","m\\u0065ssages":[{"role":"user"}]}',
        b'{"messages":[{"role":"user"}],"m\\u0065ssages":[{"role":"x"}]}',  # decodes to the second array
        b'{"m\\u0065ssages":[{"role":"x"}],"messages":[{"role":"user"}]}',
        b'[{"messages":[]}]',
    ],
)
def test_bodies_the_scan_cannot_lay_out_are_never_reused(raw):
    assert body_reuse.fresh(raw, orjson.loads(raw), "messages") is None


def test_string_items_and_empty_arrays_lay_out_and_whitespace_is_kept_exactly():
    raw = b'{ "model" : "m" , "messages" : [ "a" , {"role": "user", "content": "[}\\"{]"} ,"b"\n] , "x": [] }'
    layout = first(raw)
    assert [raw[end - 1 : end] for end in layout.ends] == [b'"', b"}", b'"'] and raw[layout.close] == ord("]")
    empty = b'{"messages": [ ], "model": "m"}'
    assert first(empty).ends == []
    grown = raw.replace(b'"b"\n]', b'"b", "c"\n]')
    body, layout = body_reuse.reuse(grown, first(raw), DEPTH, NEW)
    assert body == orjson.loads(grown) and len(layout.ends) == 4


@pytest.mark.parametrize("glued", [b".5", b"e5", b"E-1", b".5e3", b"5", b"null", b"]"])
def test_bytes_glued_to_a_shared_item_are_refused_as_the_whole_decoding_refuses_them(glued):
    """Found in review: with a `0` placeholder, `[{...}.5]` spliced to `[0.5]`, valid JSON; `null` takes no suffix."""
    messages = [message(i) for i in range(3)]
    previous = first(encode({"model": "m", "messages": messages}))
    raw = encode({"model": "m", "messages": messages})
    raw = raw[: previous.ends[-1]] + glued + raw[previous.ends[-1] :]
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(raw)
    assert body_reuse.reuse(raw, previous, DEPTH, NEW) is None


def test_a_big_new_part_is_left_to_the_whole_decoding():
    messages = [message(i) for i in range(3)]
    previous = first(encode({"model": "m", "messages": messages}))
    raw = encode({"model": "m", "messages": [*messages, message(3, "x" * 5000)]})
    assert body_reuse.reuse(raw, previous, DEPTH, 1000) is None
    assert body_reuse.reuse(raw, previous, DEPTH, 10_000) is not None


def test_what_the_spliced_decoding_refuses_is_left_to_the_whole_decoding():
    messages = [message(i) for i in range(3)]
    previous = first(encode({"model": "m", "messages": messages}))
    whole = encode({"model": "m", "messages": [*messages, message(3)]})
    for raw in (whole[:-2], whole.replace(b'"m3 ', b'"m3 \xff'), whole + b"x"):
        assert body_reuse.reuse(raw, previous, DEPTH, NEW) is None
        with pytest.raises(orjson.JSONDecodeError):
            orjson.loads(raw)
    deep = encode({"model": "m", "messages": [*messages, {"content": [[[[[[[[1]]]]]]]]}]})
    assert body_reuse.reuse(deep, previous, 8, NEW) is None  # the server's whole decoding then answers its 400
    assert body_reuse.reuse(deep, previous, DEPTH, NEW) is not None


def test_a_body_that_only_repeats_the_previous_one_or_drops_items_is_exact():
    messages = [message(i) for i in range(6)]
    raw = encode({"model": "m", "messages": messages})
    previous = first(raw)
    body, layout = body_reuse.reuse(raw, previous, DEPTH, NEW)  # an identical retry
    assert body == orjson.loads(raw) and layout.ends == previous.ends
    fewer = encode({"model": "m", "messages": messages[:4]})
    body, layout = body_reuse.reuse(fewer, previous, DEPTH, NEW)
    assert body == orjson.loads(fewer) and layout.ends == body_reuse.layout_of(fewer, "messages")[1]


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)  # what UTF-8 can carry
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
ITEMS = st.lists(st.dictionaries(st.sampled_from(["role", "content", "x"]), JSON, max_size=3), max_size=6)
EDITS = st.lists(
    st.tuples(st.sampled_from(["append", "edit", "drop", "head", "tail", "style"]), st.integers(0, 50), ITEMS),
    min_size=1,
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(ITEMS, EDITS)
def test_request_after_request_the_reused_decoding_is_the_whole_decoding(items, edits):
    """A thread's bodies under any sequence of edits (items appended, edited or dropped, head or tail keys changed,
    the writer's spacing changed): each decodes to exactly `orjson.loads` of its bytes, and its layout is the
    scan's of those bytes."""
    messages, head, tail, style = list(items), {"model": "m"}, {"stream": True}, "compact"
    previous = None
    for kind, at, new in edits:
        if kind == "append":
            messages += new
        elif kind == "edit" and messages:
            messages[at % len(messages)] = {"edited": at, **(new[0] if new else {})}
        elif kind == "drop":
            messages = messages[: at % (len(messages) + 1)]
        elif kind == "head":
            head = {"model": f"m{at}"}
        elif kind == "tail":
            tail = {"stream": bool(at % 2), "max_tokens": at}
        else:
            style = "spaced" if style == "compact" else "compact"
        raw = encode({**head, "messages": messages, **tail}, style)
        reused = body_reuse.reuse(raw, previous, DEPTH, NEW) if previous is not None else None
        if reused is None:
            body, layout = orjson.loads(raw), None
            layout = body_reuse.fresh(raw, body, "messages")
        else:
            body, layout = reused
        assert body == orjson.loads(raw)
        assert layout is not None  # these bodies always lay out: objects as items, keys plainly spelled
        assert (layout.open, layout.ends, layout.close) == body_reuse.layout_of(raw, "messages")
        assert layout.items is body["messages"]
        previous = layout


def test_the_history_field_is_the_dialects_and_another_key_of_that_name_is_never_taken_for_it():
    """The Responses API resends `input`; a `messages` key there is just another field."""
    items = [{"type": "message", "role": "user", "content": f"m{i}"} for i in range(3)]
    raw = encode({"model": "m", "input": items, "messages": [1, 2]})
    previous = body_reuse.fresh(raw, orjson.loads(raw), "input")
    assert previous is not None and previous.field == "input" and previous.items == items
    grown = encode(
        {"model": "m", "input": [*items, {"type": "message", "role": "user", "content": "m3"}], "messages": [1, 2]}
    )
    body, layout = body_reuse.reuse(grown, previous, DEPTH, NEW)
    assert body == orjson.loads(grown) and len(layout.ends) == 4
    twice = grown[:-1] + b', "input": []}'
    assert body_reuse.reuse(twice, previous, DEPTH, NEW) is None
    assert body_reuse.fresh(raw, orjson.loads(raw), "messages") is None  # [1, 2]: numbers are not laid out


GLUE = st.binary(max_size=12) | st.sampled_from([b".5", b"e5", b"E-1", b"}", b"]", b",", b", {}", b"]}", b'"', b"\\"])


@settings(max_examples=300, deadline=None)
@given(ITEMS, st.integers(0, 20), GLUE, st.booleans())
def test_whatever_bytes_follow_the_shared_items_reuse_decodes_as_the_whole_decoding_or_gives_up(
    items, at, glue, keep_rest
):
    """Any bytes after a shared item (valid or not, the rest of the body kept or cut off): `reuse` returns exactly
    `orjson.loads` of the body, or None; never a body the whole decoding refuses."""
    raw = encode({"model": "m", "messages": [message(0), *items], "stream": True})
    previous = first(raw)
    cut = previous.ends[at % len(previous.ends)]
    new = raw[:cut] + glue + (raw[cut:] if keep_rest else b"")
    reused = body_reuse.reuse(new, previous, DEPTH, NEW)
    try:
        whole = orjson.loads(new)
    except orjson.JSONDecodeError:
        assert reused is None
        return
    if reused is not None:
        assert reused[0] == whole
        assert (reused[1].open, reused[1].ends, reused[1].close) == body_reuse.layout_of(new, "messages")
