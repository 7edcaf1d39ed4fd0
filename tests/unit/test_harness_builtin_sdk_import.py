"""The builtin agent imports its SDK without aiohttp (`gyre.harness.builtin.agent.import_sdk`): every execution's
harness is a fresh process, and both SDKs import aiohttp eagerly when installed, for an async transport the agent
never uses. A fresh interpreter each: this one may have imported aiohttp already."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
from gyre.harness.builtin.agent import import_sdk
sdk = import_sdk({name!r})
assert "aiohttp" not in sys.modules, "aiohttp was imported"
client = {client}
import aiohttp  # afterwards it imports as usual
print("ok", type(client).__name__, aiohttp.__name__)
"""


@pytest.mark.parametrize(
    ("name", "client"),
    [
        ("openai", "sdk.OpenAI(base_url='http://127.0.0.1:9/v1', api_key='k', max_retries=0)"),
        ("anthropic", "sdk.Anthropic(base_url='http://127.0.0.1:9', api_key='k', max_retries=0)"),
    ],
)
def test_the_sdk_imports_without_aiohttp_and_builds_its_client(name, client):
    done = subprocess.run(
        [sys.executable, "-c", CHECK.format(name=name, client=client)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok "), done.stdout
