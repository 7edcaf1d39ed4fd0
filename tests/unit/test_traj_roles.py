"""Role classes (Eq. 4) and the per-harness role classifiers, from the signals in docs/harness.md.

Convention as in test_traj_tree: system prompts 1..9, user text 10..19, outputs 20..29 and 40..49,
tool results 30..39. Each test tree's leaves are read off the insert sequence.
"""

from __future__ import annotations

import logging

import pytest

from gyre.traj import PRIORITY, CallMeta, Provenance, Response, Role, Segment, TrajectoryTree
from gyre.traj.roles import (
    BuiltinClassifier,
    ClaudeCodeClassifier,
    CodexClassifier,
    GenericClassifier,
    classifier_for,
    classify_leaves,
    count_by_role,
    is_claude_code_summary_request,
)
from gyre.traj.synthetic import synthetic_execution

SYS, USR, TOOL, OUT = Provenance.SYSTEM, Provenance.USER, Provenance.TOOL, Provenance.SAMPLED

# The block Claude Code appends to the last user message of a summary request (abridged).
CLAUDE_CODE_COMPACTION_TEXT = (
    "Your task is to create a detailed summary of the conversation so far, paying close attention to the "
    "user's explicit requests and your previous actions. Before providing your final summary, wrap your "
    "analysis in <analysis> tags ... Your summary should include the following sections: ...\n"
    "<example>\n<analysis>\n[Your thought process]\n</analysis>\n\n<summary>\n1. Primary Request and Intent: "
    "...\n</summary>\n</example>"
)


def seg(provenance: Provenance, *ids: int) -> Segment:
    return Segment(provenance, list(ids))


def one_call_tree(signals: dict, system: tuple[int, ...] = (1, 2)) -> tuple[TrajectoryTree, int]:
    """A tree with one call whose response is the only leaf; returns (tree, leaf)."""
    tree = TrajectoryTree("ex", 100)
    record = tree.insert(
        [seg(SYS, *system), seg(USR, 10)],
        Response.build([20], [-0.5], "stop"),
        CallMeta("ex", "r0", role_signals=signals),
    )
    return tree, record.response_node


def role_of(classifier, signals: dict) -> Role:
    tree, leaf = one_call_tree(signals)
    return classifier(tree, leaf)


def test_priority_is_eq_4():
    assert [role.value for role in PRIORITY] == ["main", "main-summary", "sub-agent", "sub-agent-summary"]
    assert [role.rank for role in PRIORITY] == [0, 1, 2, 3]
    assert Role.of(sub_agent=True, summary=True) is Role.SUB_AGENT_SUMMARY
    assert Role.of(sub_agent=False, summary=True) is Role.MAIN_SUMMARY
    assert Role.from_label("sub-agent") is Role.SUB_AGENT
    with pytest.raises(ValueError, match="unknown role 'subagent'; expected one of: main, main-summary"):
        Role.from_label("subagent")


@pytest.mark.parametrize(
    ("signals", "expected"),
    [
        ({}, Role.MAIN),
        ({"last_user_text": "Fix the failing test in parser.py"}, Role.MAIN),
        ({"agent_id": "a3f9c2"}, Role.SUB_AGENT),
        ({"agent_id": ""}, Role.MAIN),  # an empty header value is no agent id
        ({"summary_request": True}, Role.MAIN_SUMMARY),
        ({"last_user_text": CLAUDE_CODE_COMPACTION_TEXT}, Role.MAIN_SUMMARY),
        ({"agent_id": "a3f9c2", "last_user_text": CLAUDE_CODE_COMPACTION_TEXT}, Role.SUB_AGENT_SUMMARY),
        ({"agent_id": "a3f9c2", "summary_request": True}, Role.SUB_AGENT_SUMMARY),
        # The proxy's explicit verdict wins over the text.
        ({"summary_request": False, "last_user_text": CLAUDE_CODE_COMPACTION_TEXT}, Role.MAIN),
    ],
)
def test_claude_code(signals, expected):
    assert role_of(ClaudeCodeClassifier(), signals) is expected


def test_claude_code_summary_text_needs_the_phrase_and_both_tags():
    assert is_claude_code_summary_request(CLAUDE_CODE_COMPACTION_TEXT)
    assert not is_claude_code_summary_request("Write a detailed summary of README.md")
    assert not is_claude_code_summary_request("Put your answer in <summary> tags")


@pytest.mark.parametrize(
    ("signals", "expected"),
    [
        ({}, Role.MAIN),
        ({"request_kind": "turn"}, Role.MAIN),
        ({"request_kind": "compaction"}, Role.MAIN_SUMMARY),
        ({"request_kind": "turn", "thread_source": "subagent", "parent_thread_id": "t-1"}, Role.SUB_AGENT),
        ({"request_kind": "compaction", "thread_source": "subagent"}, Role.SUB_AGENT_SUMMARY),
        ({"request_kind": "turn", "thread_source": "user"}, Role.MAIN),
    ],
)
def test_codex(signals, expected):
    assert role_of(CodexClassifier(), signals) is expected


@pytest.mark.parametrize("role", PRIORITY)
def test_builtin_takes_gyre_role(role):
    assert role_of(BuiltinClassifier(), {"gyre_role": role.value}) is role


@pytest.mark.parametrize(
    ("signals", "message"),
    [
        ({}, "request 'r0' has no role signal 'gyre_role'"),
        ({"gyre_role": "summary"}, "role signal 'gyre_role' of request 'r0': unknown role 'summary'"),
        ({"gyre_role": 2}, "role signal 'gyre_role' of request 'r0' has type int; expected str"),
    ],
)
def test_builtin_rejects_missing_or_unknown_roles(signals, message):
    with pytest.raises(ValueError, match=message):
        role_of(BuiltinClassifier(), signals)


@pytest.mark.parametrize(
    ("classifier", "signals"),
    [
        (ClaudeCodeClassifier(), {"summary_request": "yes"}),
        (ClaudeCodeClassifier(), {"agent_id": True}),
        (CodexClassifier(), {"request_kind": 1}),
        (GenericClassifier(), {"summary_request": 1}),
    ],
)
def test_wrong_signal_types_are_an_error(classifier, signals):
    with pytest.raises(ValueError, match=r"role signal .* of request 'r0' has type"):
        role_of(classifier, signals)


def generic_tree() -> TrajectoryTree:
    """Main agent under system prompt 1 (first request), a compaction, and a sub-agent under prompt 2.

    Nodes: 1 SYS[1] 2 USR[10] 3 OUT[20]; 4 TOOL[30] 5 OUT[40] (main leaf);
    6 TOOL[31] 7 USR[11] 8 OUT[41] (summary leaf); 9 SYS[2] 10 USR[12] 11 OUT[21] (sub-agent leaf).
    """
    tree = TrajectoryTree("ex", 100)

    def call(request, context, output, **signals):
        tree.insert(
            context, Response.build(output, [-0.5] * len(output), "stop"), CallMeta("ex", request, role_signals=signals)
        )

    main = [seg(SYS, 1), seg(USR, 10)]
    call("r0", main, [20])
    call("r1", [*main, seg(OUT, 20), seg(TOOL, 30)], [40])
    call("r2", [*main, seg(OUT, 20), seg(TOOL, 31), seg(USR, 11)], [41], summary_request=True)
    call("r3", [seg(SYS, 2), seg(USR, 12)], [21], request_kind="turn")
    return tree


def test_generic_uses_the_first_root_segment_and_summary_signals():
    tree = generic_tree()
    assert classify_leaves(tree, GenericClassifier()) == {5: Role.MAIN, 8: Role.MAIN_SUMMARY, 11: Role.SUB_AGENT}


def test_generic_honours_an_explicit_gyre_role_and_codex_compaction():
    tree = generic_tree()
    tree.insert(
        [seg(SYS, 2), seg(USR, 12), seg(OUT, 21), seg(TOOL, 32)],
        Response.build([42], [-0.5], "stop"),
        CallMeta("ex", "r4", role_signals={"request_kind": "compaction"}),
    )
    tree.insert(
        [seg(SYS, 3)], Response.build([43], [-0.5], "stop"), CallMeta("ex", "r5", role_signals={"gyre_role": "main"})
    )
    roles = classify_leaves(tree, GenericClassifier())
    assert roles == {5: Role.MAIN, 8: Role.MAIN_SUMMARY, 13: Role.SUB_AGENT_SUMMARY, 15: Role.MAIN}
    assert count_by_role(roles) == {"main": 2, "main-summary": 1, "sub-agent": 0, "sub-agent-summary": 1}


def test_a_leaf_several_calls_produced_takes_the_highest_priority_role():
    tree, leaf = one_call_tree({"gyre_role": "sub-agent-summary"})
    tree.insert(
        [seg(SYS, 1, 2), seg(USR, 10)],
        Response.build([20], [-0.5], "stop"),
        CallMeta("ex", "r1", role_signals={"gyre_role": "main-summary"}),
    )
    assert tree.nodes[leaf].calls == [0, 1]
    assert BuiltinClassifier()(tree, leaf) is Role.MAIN_SUMMARY


def test_generic_classifies_the_synthetic_execution_as_planned():
    execution = synthetic_execution(seed=3)
    tree = execution.build_tree()
    roles = classify_leaves(tree, classifier_for("generic"))
    assert len(roles) == 10
    for leaf, role in roles.items():
        assert {execution.plan[c].role for c in tree.nodes[leaf].calls} == {role.value}
    assert count_by_role(roles) == {"main": 4, "main-summary": 1, "sub-agent": 4, "sub-agent-summary": 1}


@pytest.mark.parametrize(
    ("harness", "kind"),
    [
        ("claude_code", ClaudeCodeClassifier),
        ("Claude-Code", ClaudeCodeClassifier),
        ("codex", CodexClassifier),
        ("builtin", BuiltinClassifier),
        ("generic", GenericClassifier),
    ],
)
def test_classifier_for_known_harnesses(harness, kind):
    assert type(classifier_for(harness)) is kind


def test_unknown_harness_gets_generic_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="gyre.traj.roles"):
        classifier = classifier_for("aider")
    assert isinstance(classifier, GenericClassifier)
    assert "unknown harness 'aider': using the generic role classifier" in caplog.text


def test_classify_leaves_rejects_a_classifier_that_returns_no_role():
    tree, _ = one_call_tree({})
    with pytest.raises(TypeError, match="returned 'main' for leaf 3; expected a Role"):
        classify_leaves(tree, lambda tree, leaf: "main")


def test_one_generic_classifier_serves_growing_and_different_trees():
    generic = GenericClassifier()
    tree = generic_tree()
    assert classify_leaves(tree, generic) == {5: Role.MAIN, 8: Role.MAIN_SUMMARY, 11: Role.SUB_AGENT}
    tree.insert(
        [seg(SYS, 2), seg(USR, 12), seg(OUT, 21), seg(TOOL, 32)],
        Response.build([42], [-0.5], "stop"),
        CallMeta("ex", "r4"),
    )
    assert classify_leaves(tree, generic) == {5: Role.MAIN, 8: Role.MAIN_SUMMARY, 13: Role.SUB_AGENT}
    other, leaf = one_call_tree({}, system=(2,))  # node ids overlap the first tree's: the cache must not leak
    assert generic(other, leaf) is Role.MAIN
    assert classify_leaves(tree, generic)[13] is Role.SUB_AGENT
