"""The role signals the proxy records are the ones the role classifiers read (gyre.traj.roles)."""

from __future__ import annotations

from gyre.proxy.conversation import ChatRequest, Turn
from gyre.proxy.dialects import DIALECTS_BY_NAME
from gyre.traj.roles import CLAUDE_CODE_SUMMARY_PHRASE, CLAUDE_CODE_SUMMARY_TAGS, Role, classifier_for


def role_signals(request: ChatRequest) -> dict:
    """What the proxy records for `request`: its dialect's role signals (as `gyre.proxy.server` calls them)."""
    return DIALECTS_BY_NAME[request.dialect].role_signals(request)


SUMMARY_TEXT = f"Please write {CLAUDE_CODE_SUMMARY_PHRASE}: " + " ".join(CLAUDE_CODE_SUMMARY_TAGS)


def request(dialect: str, last_user: str, signals: dict) -> ChatRequest:
    turns = (Turn(role="user", text="task"), Turn(role="assistant", text="ok"), Turn(role="user", text=last_user))
    return ChatRequest(dialect=dialect, model="gyre", system="s", turns=turns, signals=signals)


def test_claude_code_sub_agents_and_compaction_are_classified_from_the_recorded_signals():
    classify = classifier_for("claude_code").call_role
    main = role_signals(request("anthropic", "go on", {"x-claude-code-session-id": "s1"}))
    sub = role_signals(request("anthropic", "go on", {"x-claude-code-agent-id": "a7"}))
    summary = role_signals(request("anthropic", SUMMARY_TEXT, {}))
    sub_summary = role_signals(request("anthropic", SUMMARY_TEXT, {"x-claude-code-agent-id": "a7"}))
    assert classify(main, "r") == Role.MAIN
    assert classify(sub, "r") == Role.SUB_AGENT and sub["agent_id"] == "a7"
    assert classify(summary, "r") == Role.MAIN_SUMMARY and summary["summary_request"] is True
    assert classify(sub_summary, "r") == Role.SUB_AGENT_SUMMARY
    assert main["x-claude-code-session-id"] == "s1"  # the headers themselves are kept


def test_other_dialects_keep_their_signals_as_parsed():
    signals = {"request_kind": "compaction", "thread_source": "subagent"}
    assert role_signals(request("openai_responses", "go on", signals)) == signals


def test_a_compaction_request_is_flagged_the_same_in_every_dialect():
    """Issue 13 finding 11: only the Anthropic dialect flagged it, so an OpenAI client's compaction leaf was
    classified main by the generic classifier (which reads `summary_request` as the claude_code one does)."""
    classify = classifier_for("claude_code").call_role
    for dialect in ("anthropic", "openai_chat", "openai_responses"):
        summary = role_signals(request(dialect, SUMMARY_TEXT, {}))
        plain = role_signals(request(dialect, "go on", {}))
        assert summary.get("summary_request") is True and "summary_request" not in plain, dialect
        assert classify(summary, "r") == Role.MAIN_SUMMARY and classify(plain, "r") == Role.MAIN, dialect


def test_every_dialect_takes_the_gyre_role_headers():
    from gyre.proxy.dialects import anthropic, openai_chat, openai_responses
    from gyre.proxy.sessions import thread_key

    headers = {"X-Gyre-Role": "sub-agent", "x-gyre-agent-id": "helper-2", "anthropic-version": "2023-06-01"}
    parsed = [
        anthropic.parse_request(
            {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, headers, {}
        ),
        openai_chat.parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, headers, {}),
        openai_responses.parse_request({"model": "m", "input": "hi"}, headers, {}),
    ]
    classify = classifier_for("builtin").call_role
    for chat in parsed:
        signals = role_signals(chat)
        assert signals["gyre_role"] == "sub-agent", chat.dialect
        assert classify(signals, "r") == Role.SUB_AGENT
        assert thread_key(signals) == "x-gyre-agent-id=helper-2"  # a sub-agent's own conversation thread
