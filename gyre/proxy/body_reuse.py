"""Decode a call's body without decoding the history it shares, byte for byte, with its thread's previous body.

Harnesses resend the whole history on every call (docs/harness.md, the prefix property): at a 700K-token history
the body is ~1.4 MB, and decoding it all (`orjson.loads`, ~1.5-2 ms) was the largest single cost of a call
(docs/proxy.md, "Performance"). The previous body's bytes are kept with the offsets where each item of its history
array ends (the dialect's `history_field`: `messages`, or the Responses API's `input`; `messages` below). A new
body that starts with the same bytes up to the end of item k-1 holds those k items unchanged, so only the rest is
decoded: the new body with those bytes replaced by one placeholder,

    {"model": ..., "messages": [<k unchanged items>, <new items>], ...}
    {"model": ..., "messages": [null, <new items>], ...}

whose decoding is the whole body's with the placeholder standing for the k items, which are taken from the previous
decoding (the same objects). The placeholder is `null`, which no byte that may follow it can extend (a `0` would
make a following `.5` a number). Comparing bytes is a `memcmp` in place, ~20 us for 1.4 MB.

Exactness: the replaced bytes are a comma-separated run of complete JSON values inside an array (the previous body
decoded, and they are the same bytes) ending in `}`, `]` or `"`, so the new body is valid JSON exactly when the
spliced one is, and decodes to the same value. The offsets come from `layout_of`, a scan of strings and brackets
that is exact on valid JSON and is only ever used on a body that decoded. A body is reused only when its top-level
object has exactly one key spelled `"messages"`, no key written with escapes (`"m\\u0065ssages"` decodes to the same
key), and every item is an object, an array or a string (whose ends the scan finds); anything else is decoded
whole, as before. Pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from gyre.proxy.dialects.fields import nesting_depth_exceeds

# A JSON string (unrolled: long strings are skipped in C), or one structural character.
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[][{}:,]', re.DOTALL)
_QUOTE, _COMMA = ord('"'), ord(",")
_OPEN, _CLOSE, _SKIPPED = frozenset(b"{["), frozenset(b"}]"), frozenset(b'":,')


@dataclass(frozen=True, slots=True)
class Layout:
    """A decoded body and where its history array lies in its bytes."""

    raw: bytes
    field: str  # the history array's key
    open: int  # just after the array's `[`
    ends: list[int]  # just after each item
    close: int  # at the array's `]`
    items: list[Any]  # the decoded items (the same objects the decoded body holds)

    def shared_items(self, raw: bytes) -> int:
        """How many leading items `raw` shares with this body, byte for byte (with everything before them)."""
        ends, previous = self.ends, memoryview(self.raw)

        def shares(k: int) -> bool:  # memcmp in place: slicing 1.4 MB copies would cost ~1 ms each
            return len(raw) > ends[k - 1] and raw.startswith(previous[: ends[k - 1]])

        n = len(ends)
        if not n or not shares(1):
            return 0
        for k in (n, n - 1):  # the usual cases: history extended, or its last item changed as well
            if k and shares(k):
                return k
        low, high = 1, n - 2  # shares `low` items, not `high + 1`: bisect (prefix equality is monotone)
        while low < high:
            mid = (low + high + 1) // 2
            if shares(mid):
                low = mid
            else:
                high = mid - 1
        return low


def reuse(raw: bytes, previous: Layout, max_depth: int, max_new_bytes: int) -> tuple[Any, Layout] | None:
    """`raw` decoded with the items it shares with `previous` taken from it, and its layout; None to decode it
    whole: it shares no item, or more than `max_new_bytes` follow them (their scan is Python, a step per string and
    bracket, where decoding them whole is C), or the spliced decoding refuses it or nests containers over
    `max_depth` levels (the whole decoding then names the error at the offsets the client sent; the shared items
    passed this check before)."""
    shared = previous.shared_items(raw)
    if not shared:
        return None
    cut = previous.ends[shared - 1]
    if len(raw) - cut > max_new_bytes:
        return None
    try:
        body = orjson.loads(b"".join((memoryview(raw)[: previous.open], b"null", memoryview(raw)[cut:])))
    except orjson.JSONDecodeError:
        return None
    field = previous.field
    messages = body.get(field) if type(body) is dict else None
    if type(messages) is not list or not messages:
        return None  # cannot be, the head being the previous body's; never splice what does not add up
    if nesting_depth_exceeds(body, max_depth):
        return None
    scanned = _items(raw, cut, first=False)
    if scanned is None:
        return None
    new_ends, close = scanned
    if len(new_ends) != len(messages) - 1:
        return None
    tail = memoryview(previous.raw)[previous.close :]
    if not (len(raw) - close == len(tail) and raw.endswith(tail)) and (
        _next_key(raw, close + 1, _key(field), expect_key=False) is not True
    ):
        return None
    items = previous.items[:shared] + messages[1:]
    body[field] = items
    return body, Layout(raw, field, previous.open, previous.ends[:shared] + new_ends, close, items)


def fresh(raw: bytes, body: Any, field: str) -> Layout | None:
    """The layout of `raw`, which decoded whole to `body`, around its history array `field`; None when it cannot be
    reused (see the module's rules). A scan of the whole body in Python, ~12 ms at 1.4 MB: once per thread, not per
    call."""
    if type(body) is not dict or type(body.get(field)) is not list:
        return None
    found = layout_of(raw, field)
    if found is None or len(found[1]) != len(body[field]):  # the count cannot differ on valid JSON
        return None
    start, ends, close = found
    return Layout(raw, field, start, ends, close, body[field])


def layout_of(raw: bytes, field: str) -> tuple[int, list[int], int] | None:
    """(just after `[`, each item's end, the `]`) of the top-level array `field` of valid JSON `raw`, or None (see
    the module's rules)."""
    wanted = _key(field)
    first = _TOKEN.search(raw)
    if first is None or raw[first.start()] != ord("{"):
        return None
    key = _next_key(raw, first.end(), wanted, expect_key=True)
    if not isinstance(key, re.Match):
        return None
    colon = _TOKEN.search(raw, key.end())
    bracket = _TOKEN.search(raw, colon.end()) if colon is not None else None
    if bracket is None or raw[bracket.start()] != ord("["):
        return None  # the history is not an array
    scanned = _items(raw, bracket.end(), first=True)
    if scanned is None or _next_key(raw, scanned[1] + 1, wanted, expect_key=False) is not True:
        return None
    return bracket.end(), *scanned


def _items(raw: bytes, pos: int, *, first: bool) -> tuple[list[int], int] | None:
    """From `pos` inside an array (just after its `[` when `first`, else just after an item): the end of each item
    that follows and the offset of the array's `]`; None at an item that is a number, `true`, `false` or `null`."""
    ends: list[int] = []
    depth = 0
    awaiting = first  # an item must begin before the next `,` or `]` at this level
    for match in _TOKEN.finditer(raw, pos):
        char = raw[match.start()]
        if depth == 0:
            if char == _COMMA:
                if awaiting:
                    return None
                awaiting = True
            elif char == _QUOTE:
                ends.append(match.end())
                awaiting = False
            elif char in _OPEN:
                depth = 1
            else:  # `]`: the array's end (a `}` cannot close an array in valid JSON)
                if awaiting and (ends or not first):
                    return None  # a scalar item just before the end
                if first and not ends and _gap_holds_value(raw, pos, match.start()):
                    return None
                return ends, match.start()
        elif char in _SKIPPED:
            continue
        elif char in _OPEN:
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                ends.append(match.end())
                awaiting = False
    return None


def _gap_holds_value(raw: bytes, start: int, stop: int) -> bool:
    """Whether anything but whitespace lies between `start` and `stop` (`[5]`: one scalar item, not an empty array)."""
    return bool(raw[start:stop].strip(b" \t\r\n"))


def _key(field: str) -> bytes:
    """`field` as a plainly spelled JSON key."""
    return b'"' + field.encode() + b'"'


def _next_key(raw: bytes, pos: int, wanted: bytes, *, expect_key: bool) -> re.Match | bool:
    """Walking the top-level object's keys from `pos` (inside it; `expect_key` when a key comes next): the match of
    key `wanted` when it is among them, True at the object's end without it, False at a key written with escapes."""
    depth = 1
    for match in _TOKEN.finditer(raw, pos):
        char = raw[match.start()]
        if depth == 1 and char == _COMMA:
            expect_key = True
        elif depth == 1 and char == _QUOTE and expect_key:
            key = match.group()
            if b"\\" in key:
                return False
            if key == wanted:
                return match
            expect_key = False
        elif char in _OPEN:
            depth += 1
        elif char in _CLOSE:
            depth -= 1
            if depth == 0:
                return True
    return False
