"""Chat templating with TITO (gyre.proxy.render, gyre.proxy.payload) on the tiny model's template and tokenizer."""

from __future__ import annotations

import json
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.models.chat_template import render_chat
from gyre.models.tiny import tiny_model_dir
from gyre.proxy.conversation import AssistantOutput, ChatRequest, ToolCall, ToolSpec, Turn, compact_json
from gyre.proxy.payload import PayloadCache
from gyre.proxy.render import ChatTemplate, PromptBuilder, windowed_rendering
from gyre.traj.record import CallMeta, Provenance, Response
from gyre.traj.tree import TrajectoryTree

TOOLS = (
    ToolSpec(name="read", description="Read a file", parameters={"type": "object", "properties": {"path": {}}}),
    ToolSpec(name="run", description="Run a command", parameters={"type": "object"}),
)
SYSTEM = "You are a careful coding agent."


@cache
def template() -> ChatTemplate:
    return ChatTemplate.from_pretrained(tiny_model_dir())


def request(turns, system=SYSTEM, tools=TOOLS) -> ChatRequest:
    return ChatRequest(dialect="anthropic", model="tiny", system=system, turns=tuple(turns), tools=tools)


def model_output(step: int) -> AssistantOutput:
    """What our model answered at `step`: thinking, text and a tool call with our own id."""
    arguments = f'{{"path": "src/f{step}.py", "mode": "r"}}'
    call = ToolCall(id=f"toolu_{step:02d}", name="read", arguments=arguments)
    return AssistantOutput(text=f"Reading file {step}.", thinking=f"I need f{step}.", tool_calls=(call,))


def output_ids(output: AssistantOutput) -> list[int]:
    """The ids our engine 'produced': the template's assistant content, ending with the <|im_end|> stop id."""
    tpl = template()
    message = tpl.message(
        Turn(role="assistant", text=output.text, thinking=output.thinking, tool_calls=output.tool_calls)
    )
    text = render_chat([message], add_generation_prompt=False)
    assert text.startswith(tpl.generation_prompt) and text.endswith("<|im_end|>\n")
    return tpl.encode(text[len(tpl.generation_prompt) : -1])


def echoed(output: AssistantOutput) -> Turn:
    """The harness's echo: arguments re-serialized (compact JSON, keys reordered) as a client would send them."""
    calls = tuple(
        ToolCall(id=c.id, name=c.name, arguments=compact_json(dict(reversed(json.loads(c.arguments).items()))))
        for c in output.tool_calls
    )
    return Turn(role="assistant", text=output.text, thinking=output.thinking, tool_calls=calls)


def run_conversation(steps: int = 6):
    """Six model calls; each request extends the previous one with our (echoed) answer and a tool result."""
    tpl = template()
    payloads = PayloadCache()
    builder = PromptBuilder(tpl, payloads)
    tree = TrajectoryTree("exec-1", tpl.vocab_size)
    turns: list[Turn] = [Turn(role="user", text="Fix the failing test in src/.")]
    history = []
    for step in range(steps):
        prompt = builder.build(request(turns))
        output = model_output(step)
        ids = output_ids(output)
        payloads.remember(output, ids)
        response = Response.build(ids, [-0.5] * len(ids), "tool_use")
        tree.insert(prompt.segments, response, CallMeta(execution="exec-1", request_id=f"r{step}"))
        history.append((prompt, output, ids))
        turns += [
            echoed(output),
            Turn(role="tool", text=f"contents of f{step}\nline 2", tool_call_id=f"toolu_{step:02d}"),
        ]
    return tpl, tree, history


def test_template_facts():
    tpl = template()
    assert tpl.generation_prompt == "<|im_start|>assistant\n"
    assert tpl.assistant_footer == "<|im_end|>\n" and tpl.footer_stop_text == "<|im_end|>"
    assert tpl.end_of_turn_ids == (tpl.tokenizer.token_to_id("<|im_end|>"),)
    assert tpl.mid_system_role == "user"  # the tiny template raises on a non-first system message
    assert windowed_rendering(tpl)
    assert tpl.encode("<|im_start|>user\n")[0] == tpl.tokenizer.token_to_id("<|im_start|>")


def test_rendering_matches_reference_template_with_tools():
    tpl = template()
    turns = [
        Turn(role="user", text="hi"),
        echoed(model_output(0)),
        Turn(role="tool", text="x", tool_call_id="toolu_00"),
    ]
    req = request(turns)
    assert tpl.render_request(req) == render_chat(tpl.messages(req), [t.as_template_tool() for t in TOOLS])


def test_six_turn_conversation_ids_keys_and_tree_sharing():
    tpl, tree, history = run_conversation()
    previous = None
    for step, (prompt, _output, _ids) in enumerate(history):
        # (a) the prompt is the template's render of the conversation, tokenized turn by turn, except that our
        # echoed answers are our exact ids (the harness re-serialized their arguments).
        assert list(prompt.input_ids) == [i for s in prompt.segments for i in s.ids]
        assert prompt.num_tokens == len(prompt.input_ids)
        assert prompt.restored_turns == (1 if step else 0) and prompt.unrestored_assistant_turns == 0
        sampled = [s for s in prompt.segments if s.provenance is Provenance.SAMPLED]
        assert [list(s.ids) for s in sampled] == [h[2] for h in history[:step]]
        rendered = "".join(t for t in prompt.texts if t is not None)
        assert "<|im_start|>assistant\n" in rendered and rendered.endswith("<|im_start|>assistant\n")
        if previous is not None:
            # (c) earlier turns reuse the previous request's Segment objects: no re-render, no rehash.
            assert prompt.reused_segments == len(previous.segments)
            assert prompt.reused_tokens == sum(len(s) for s in prompt.segments[: prompt.reused_segments])
            assert all(a is b for a, b in zip(prompt.segments, previous.segments, strict=False))
            assert prompt.reused_turns == 2 * step - 1 and prompt.rendered_turns == 2
        previous = prompt
    # Our restored ids are exactly what the engine would see for the template's own rendering of our answer.
    last = history[-1][0]
    reference = request([Turn(role="user", text="Fix the failing test in src/.")])
    assert last.segments[0].provenance is Provenance.SYSTEM and last.segments[1].provenance is Provenance.USER
    assert tpl.encode(tpl.render_request(reference)) == list(history[0][0].input_ids)
    # (b) the tree walks through every recorded response: no fork, stored tokens == unique tokens.
    tree.check_invariants()
    final_context, final_output = tree.call_tokens(len(history) - 1)
    assert final_context == list(last.input_ids)
    assert tree.tokens_stored == len(final_context) + len(final_output)
    assert tree.stats().leaves == 1


@pytest.mark.parametrize("system", [SYSTEM, None])
def test_ids_equal_template_render_when_echo_is_verbatim(system):
    """Without reformatting, the whole prompt equals the tokenized one-piece render of the template; the system
    prompt and tools header is one SYSTEM segment even without a system prompt (the template writes the tools)."""
    tpl = template()
    payloads = PayloadCache()
    builder = PromptBuilder(tpl, payloads)
    turns = [Turn(role="user", text="go")]
    for step in range(3):
        prompt = builder.build(request(turns, system=system))
        full = tpl.render_request(request(turns, system=system))
        assert prompt.segments[0].provenance == Provenance.SYSTEM and prompt.texts[0].startswith("<|im_start|>system")
        assert prompt.segments[1].provenance == Provenance.USER
        assert (
            "".join(
                prompt.texts[i] or tpl.tokenizer.decode(list(s.ids), skip_special_tokens=False)
                for i, s in enumerate(prompt.segments)
            )
            == full
        )
        assert list(prompt.input_ids) == tpl.encode(full)
        output = model_output(step)
        payloads.remember(output, output_ids(output))
        turns += [
            Turn(role="assistant", text=output.text, thinking=output.thinking, tool_calls=output.tool_calls),
            Turn(role="tool", text="ok", tool_call_id=output.tool_calls[0].id),
        ]


def test_parallel_tool_results_and_length_stopped_output():
    tpl = template()
    payloads = PayloadCache()
    builder = PromptBuilder(tpl, payloads)
    turns = [Turn(role="user", text="two things")]
    builder.build(request(turns))
    calls = (ToolCall(id="a", name="run", arguments='{"cmd": "ls"}'), ToolCall(id="b", name="run", arguments="{}"))
    output = AssistantOutput(text="both", tool_calls=calls, stop_reason="tool_calls")
    ids = output_ids(output)[:-1]  # stopped by length: no <|im_end|>
    payloads.remember(output, ids)
    turns += [
        Turn(role="assistant", text="both", tool_calls=calls),
        Turn(role="tool", text="r1", tool_call_id="a"),
        Turn(role="tool", text="r2", tool_call_id="b"),
    ]
    prompt = builder.build(request(turns))
    assert prompt.restored_turns == 1
    assert [s.provenance for s in prompt.segments[-3:]] == [Provenance.SAMPLED, Provenance.TOOL, Provenance.TOOL]
    assert list(prompt.segments[-3].ids) == ids
    # The template's glue after the content (here all of "<|im_end|>\n": our output has no stop token) starts the
    # next segment; the two tool results share one user turn, one segment each.
    assert prompt.texts[-2:] == [
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nr1\n</tool_response>",
        "\n<tool_response>\nr2\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ]


def test_harness_written_assistant_is_rendered_by_template():
    tpl = template()
    builder = PromptBuilder(tpl, PayloadCache())
    turns = [
        Turn(role="user", text="summary: we fixed it"),
        Turn(role="assistant", text="Continuing."),
        Turn(role="user", text="next"),
    ]
    prompt = builder.build(request(turns))
    assert prompt.unrestored_assistant_turns == 1 and prompt.restored_turns == 0
    kinds = [s.provenance for s in prompt.segments]
    assert kinds == [Provenance.SYSTEM, Provenance.USER, Provenance.HARNESS_ASSISTANT, Provenance.USER]
    assert prompt.texts[2] == "Continuing.<|im_end|>"
    assert list(prompt.input_ids) == tpl.encode(tpl.render_request(request(turns)))


def test_changed_system_prompt_rebuilds():
    tpl = template()
    builder = PromptBuilder(tpl, PayloadCache())
    turns = [Turn(role="user", text="a"), Turn(role="assistant", text="b"), Turn(role="user", text="c")]
    first = builder.build(request(turns))
    second = builder.build(request(turns, system="A different system prompt."))
    assert second.reused_turns == 0 and second.rendered_turns == 3
    assert first.segments[0] != second.segments[0]
    assert list(second.input_ids) == tpl.encode(tpl.render_request(request(turns, system="A different system prompt.")))
    third = builder.build(request(turns, tools=()))
    assert third.reused_turns == 0 and "# Tools" not in third.texts[0]


def test_mid_conversation_system_message_renders_as_user_with_system_provenance():
    tpl = template()
    builder = PromptBuilder(tpl, PayloadCache())
    turns = [Turn(role="user", text="a"), Turn(role="system", text="<system-reminder>be brief</system-reminder>")]
    prompt = builder.build(request(turns))
    assert prompt.segments[-1].provenance is Provenance.SYSTEM
    assert (
        prompt.texts[-1]
        == "<|im_start|>user\n<system-reminder>be brief</system-reminder><|im_end|>\n<|im_start|>assistant\n"
    )


def test_identical_retry_and_divergent_history():
    tpl = template()
    builder = PromptBuilder(tpl, PayloadCache())
    turns = [Turn(role="user", text="a"), Turn(role="assistant", text="b"), Turn(role="user", text="c")]
    first = builder.build(request(turns))
    retry = builder.build(request(turns))
    assert retry.rendered_turns == 0 and all(a is b for a, b in zip(retry.segments, first.segments, strict=True))
    edited = [*turns[:2], Turn(role="user", text="c, edited")]
    prompt = builder.build(request(edited))
    assert prompt.reused_turns == 2 and prompt.segments[:3] == first.segments[:3]
    assert list(prompt.input_ids) == tpl.encode(tpl.render_request(request(edited)))


def test_two_outputs_that_read_the_same_restore_neither():
    """Issue 13 finding 13: outputs whose text is the same after the parser's strip ("hi" and "hi\\n" sampled as
    different ids) made an echo of the first restore the second's ids. Such content is ambiguous: nothing is restored
    (the template renders the turn), while an output remembered twice with the same ids still restores."""
    cache_ = PayloadCache()
    cache_.remember(AssistantOutput(text="hi"), [5, 6])
    cache_.remember(AssistantOutput(text="hi"), [5, 6])
    assert cache_.restore(Turn(role="assistant", text="hi")) == (5, 6)
    cache_.remember(AssistantOutput(text="hi"), [5, 6, 7])
    assert cache_.restore(Turn(role="assistant", text="hi")) is None
    cache_.remember(AssistantOutput(text="hi"), [5, 6])  # stays ambiguous: which of the two did the harness echo?
    assert cache_.restore(Turn(role="assistant", text="hi")) is None


def test_payload_cache_keys_and_bounds():
    cache_ = PayloadCache(max_entries=2)
    out = model_output(1)
    cache_.remember(out, [5, 6, 7])
    assert cache_.restore(echoed(out)) == (5, 6, 7)  # by call id, whatever the arguments' formatting
    other_ids = Turn(
        role="assistant", text=out.text, tool_calls=(ToolCall(id="toolu_99", name="read", arguments="{}"),)
    )
    assert cache_.restore(other_ids) is None
    cache_.remember(AssistantOutput(text="third"), [9])
    assert len(cache_) == 2 and cache_.restore(echoed(out)) == (5, 6, 7)
    cache_.remember(AssistantOutput(text="fourth"), [10])
    assert len(cache_) == 2 and cache_.restore(Turn(role="assistant", text="third")) is None  # least recently used


def test_an_answer_echoed_without_its_thinking_is_restored_with_it():
    """Harnesses and templates (Qwen3's) drop earlier thinking from the history: the echo of a plain answer is found
    by its text, and restores the ids the engine produced, thinking included (docs/proxy.md, "Thinking in the
    history"). An echo that keeps the thinking must match it; text shared by two outputs restores neither."""
    cache_ = PayloadCache()
    cache_.remember(AssistantOutput(text="done", thinking="t"), [8, 9])
    assert cache_.restore(Turn(role="assistant", text="done", thinking="t")) == (8, 9)
    assert cache_.restore(Turn(role="assistant", text="done")) == (8, 9)
    assert cache_.restore(Turn(role="assistant", text="done", thinking="other")) is None
    cache_.remember(AssistantOutput(text="done", thinking="u"), [8, 10])
    assert cache_.restore(Turn(role="assistant", text="done", thinking="u")) == (8, 10)
    assert cache_.restore(Turn(role="assistant", text="done")) is None  # which of the two? neither
    with pytest.raises(ValueError):
        cache_.remember(AssistantOutput(text="empty"), [])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(["<|im_start|>", "<|im_end|>", "user\n", " ", "\n\n", "é", "🙂", "def f(x):"])
        | st.text(max_size=40),
        max_size=12,
    )
)
def test_the_template_encodes_as_the_tokenizer_does(pieces):
    """`ChatTemplate.encode` (encode_batch_fast, the GIL released) gives the tokenizer's own `encode` ids, special
    tokens included; `encode_many` the same for each text."""
    text = "".join(pieces)
    tokenizer = template().tokenizer
    expected = tokenizer.encode(text, add_special_tokens=False).ids
    assert template().encode(text) == expected
    assert template().encode_many([text, text[:5]]) == [
        expected,
        tokenizer.encode(text[:5], add_special_tokens=False).ids,
    ]


TURN_TEXTS = st.sampled_from(["a", "b", "hello there", "x\ny", "<tool>", ""])


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["extend", "retry", "edit", "truncate", "system"]), TURN_TEXTS, st.integers(0, 8)),
        min_size=1,
        max_size=10,
    )
)
def test_a_prompts_ids_are_its_segments_whatever_it_reuses_of_the_previous(operations):
    """Whatever a thread's requests do (extend, retry, edit or drop turns, change the system prompt), each prompt's
    ids are its segments' in order, and the tokens it counts as reused are those of its reused segments: the slice
    of the previous prompt's ids that `input_ids` takes."""
    tpl = template()
    builder = PromptBuilder(tpl, PayloadCache())
    turns: list[Turn] = [Turn(role="user", text="start")]
    system = SYSTEM
    for operation, text, at in operations:
        if operation == "extend":
            turns += [Turn(role="assistant", text=f"answer {text}"), Turn(role="user", text=text or "next")]
        elif operation == "edit":
            index = at % len(turns)
            turns[index] = Turn(role=turns[index].role, text=turns[index].text + f" edited {text}")
        elif operation == "truncate" and len(turns) > 2:
            turns = turns[: max(1, at % len(turns)) | 1]  # an odd count: ends on a user turn
        elif operation == "system":
            system = f"{SYSTEM} {text}"
        prompt = builder.build(request(turns, system=system))
        assert list(prompt.input_ids) == [i for s in prompt.segments for i in s.ids]
        assert prompt.reused_tokens == sum(len(s) for s in prompt.segments[: prompt.reused_segments])
        assert prompt.num_tokens == len(prompt.input_ids)
