"""`ProxyConfig`'s output and thinking settings: SGLang's parser names, the thinking modes, one-line errors."""

from __future__ import annotations

import pytest

from gyre.config import ConfigError
from gyre.config.proxy import REASONING_PARSER_NAMES, THINKING_MODES, TOOL_CALL_PARSER_NAMES, ProxyConfig


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("tool_call_parser", "mistral", "proxy.tool_call_parser='mistral'"),
        ("reasoning_parser", "think", "proxy.reasoning_parser='think'"),
        ("thinking", "off", "proxy.thinking='off'"),
        ("thinking", False, "proxy.thinking=False"),
        ("stream_keepalive_s", -1.0, "proxy.stream_keepalive_s=-1.0"),
        ("stream_keepalive_s", float("inf"), "proxy.stream_keepalive_s=inf"),
    ],
)
def test_an_unknown_name_is_one_line_naming_the_field_and_the_choices(field, value, named):
    with pytest.raises(ConfigError) as info:
        ProxyConfig(**{field: value})
    message = str(info.value)
    assert "\n" not in message and named in message


def test_every_known_name_is_accepted():
    for name in TOOL_CALL_PARSER_NAMES:
        ProxyConfig(tool_call_parser=name)
    for name in (*REASONING_PARSER_NAMES, None):
        ProxyConfig(reasoning_parser=name)
    for mode in THINKING_MODES:
        ProxyConfig(thinking=mode)


@pytest.mark.parametrize(
    ("mode", "client_asked", "expected"),
    [
        ("template", True, None),
        ("template", False, None),
        ("enabled", False, True),
        ("disabled", True, False),
        ("client", True, True),
        ("client", False, False),
    ],
)
def test_enable_thinking_follows_the_mode(mode, client_asked, expected):
    assert ProxyConfig(thinking=mode).enable_thinking(client_asked) is expected
