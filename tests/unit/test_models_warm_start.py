"""The warm start of the tiny model (gyre.tasks.demo.warm_start) and its CLI (python -m gyre.tasks.demo warm-start).

Covers: demonstrations are deterministic in the seed and mix tool calls at the configured fraction; every
rendered sequence is token for token what the proxy's `PromptBuilder` gives for the same `ChatRequest` (the tool
call restored from the payload cache, as at RL time) and, as text, the one-piece chat-template render; the loss
mask covers exactly the sampled assistant tokens; the shared-prefix loss equals the loss of full rows; the greedy
evaluator plays demonstrated outputs to success through the same prompts; a finished warm start is reused from
disk at once; the CLI's bad arguments exit 2 with one stderr line. Budgets are tiny: the whole file runs in seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from gyre.engine.scripted import ScriptedEngine
from gyre.models.hf_weights import load_pretrained
from gyre.models.tiny import tiny_model_dir
from gyre.proxy.conversation import Turn
from gyre.proxy.payload import PayloadCache
from gyre.proxy.render import ChatTemplate, PromptBuilder
from gyre.tasks.demo.__main__ import main
from gyre.tasks.demo.warm_start import (
    META_FILE,
    Demonstration,
    WarmStartConfig,
    _play,
    demo_request,
    make_demonstrations,
    masked_loss,
    parse_output,
    shared_prefix_len,
    warm_start,
    warm_start_key,
)
from gyre.traj.record import Provenance

TINY = WarmStartConfig(num_demos=16, steps=2, batch_size=4, warmup_steps=1, tool_fraction=0.5)


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate.from_pretrained(tiny_model_dir())


@pytest.fixture(scope="module")
def demos(template) -> list[Demonstration]:
    return make_demonstrations(template, 24, seed=5, config=replace(TINY, tool_fraction=0.25))


def _decode(template: ChatTemplate, ids) -> str:
    return template.tokenizer.decode(list(ids), skip_special_tokens=False)


def test_demonstrations_are_deterministic_and_mixed(template, demos):
    again = make_demonstrations(template, 24, seed=5, config=replace(TINY, tool_fraction=0.25))
    assert [(d.input_ids, d.loss_mask, d.calls_tool) for d in again] == [
        (d.input_ids, d.loss_mask, d.calls_tool) for d in demos
    ]
    # Every product calls the tool; of the other problems, round(count * 0.25) do.
    products = [d for d in demos if " * " in d.problem.expression]
    others = [d for d in demos if " * " not in d.problem.expression]
    assert products and others and all(d.calls_tool for d in products)
    assert sum(d.calls_tool for d in others) == round(len(others) * 0.25)
    other_seed = make_demonstrations(template, 24, seed=6, config=replace(TINY, tool_fraction=0.25))
    assert [d.input_ids for d in other_seed] != [d.input_ids for d in demos]
    none = make_demonstrations(template, 8, seed=5, config=replace(TINY, tool_operators="", tool_fraction=0.0))
    assert not any(d.calls_tool for d in none)
    mixed = make_demonstrations(template, 40, seed=5, config=replace(TINY, tool_operators="", tool_fraction=0.1))
    assert sum(d.calls_tool for d in mixed) == 4
    with pytest.raises(ValueError, match="tool_operators"):
        WarmStartConfig(tool_operators="/")


def test_sequences_are_what_the_prompt_builder_renders(template, demos):
    for demo in demos:
        problem = demo.problem
        builder = PromptBuilder(template, PayloadCache())
        first = builder.build(demo_request(problem)).input_ids
        assert demo.input_ids[: len(first)] == list(first)
        answer = str(problem.answer)
        messages = [{"role": "system", "content": demo_request(problem).system}]
        messages.append({"role": "user", "content": problem.prompt})
        if demo.calls_tool:
            # The proxy's path: parse what the model sampled, remember it, restore it from the harness's echo.
            start = len(first)
            end = start + demo.loss_mask[start:].index(0)
            call_ids = demo.input_ids[start:end]
            output = parse_output(template, call_ids, "stop", "t")
            assert [(c.name, json.loads(c.arguments)) for c in output.tool_calls] == [
                ("calculator", {"expression": problem.expression})
            ]
            builder.payloads.remember(output, call_ids)
            echoed = Turn(role="assistant", text=output.text, tool_calls=output.tool_calls)
            tool = Turn(role="tool", text=answer, tool_call_id=output.tool_calls[0].id)
            second = builder.build(demo_request(problem, (echoed, tool)))
            assert second.restored_turns == 1
            assert demo.input_ids[: second.num_tokens] == list(second.input_ids)
            # Trained in the prompt: exactly the tokens the proxy marks SAMPLED (our restored output).
            sampled = [int(seg.provenance is Provenance.SAMPLED) for seg in second.segments for _ in range(len(seg))]
            assert demo.loss_mask[: second.num_tokens] == sampled and sum(sampled) == len(call_ids)
            prompt_len = second.num_tokens
            call = {"name": "calculator", "arguments": {"expression": problem.expression}}
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": answer},
            ]
        else:
            prompt_len = len(first)
        tail = demo.input_ids[prompt_len:]
        assert tail == template.encode(answer + "<|im_end|>")
        # As text: the whole episode is the one-piece chat-template render (its final "\n" is not sampled).
        messages.append({"role": "assistant", "content": answer})
        tools = [t.as_template_tool() for t in demo_request(problem).tools]
        assert _decode(template, demo.input_ids) + "\n" == template.render(messages, tools)


def test_loss_mask_covers_exactly_the_sampled_tokens(template, demos):
    for demo in demos:
        assert len(demo.loss_mask) == len(demo.input_ids) and set(demo.loss_mask) <= {0, 1}
        sampled = _decode(template, [i for i, m in zip(demo.input_ids, demo.loss_mask, strict=True) if m])
        answer = f"{demo.problem.answer}<|im_end|>"
        if demo.calls_tool:
            call = (
                '<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
                + demo.problem.expression
                + '"}}\n</tool_call><|im_end|>'
            )
            assert sampled == call + answer
            runs = "".join(map(str, demo.loss_mask)).strip("0").split("0")
            assert len([r for r in runs if r]) == 2  # two assistant turns, nothing between them trained
        else:
            assert sampled == answer
            assert demo.loss_mask[-len(template.encode(answer)) :] == [1] * len(template.encode(answer))
            assert sum(demo.loss_mask) == len(template.encode(answer))
        assert demo.loss_mask[-1] == 1  # every episode ends with a sampled stop token


def test_shared_prefix_loss_equals_full_rows(demos):
    torch.manual_seed(0)
    model = load_pretrained(tiny_model_dir())
    batch = [demos[i] for i in (0, 1, 2, 3, 5, 8)]
    assert any(d.calls_tool for d in batch) and not all(d.calls_tool for d in batch)
    prefix = shared_prefix_len(demos)
    assert 250 < prefix < len(min((d.input_ids for d in demos), key=len))  # system prompt + tools block
    fast = masked_loss(model, batch, prefix, pad_id=9)
    full = masked_loss(model, batch, 0, pad_id=9)
    assert abs(fast.item() - full.item()) < 1e-5


def demonstrated_turns(demo: Demonstration):
    """A script for `ScriptedEngine`: each call gets the demonstration's next sampled turn, after checking the prompt
    is the demonstration's."""

    def reply(request):
        ids, mask = demo.input_ids, demo.loss_mask
        start = len(request.input_ids)
        assert list(request.input_ids) == ids[:start]  # the evaluator renders exactly the trained sequence
        end = start + (mask[start:].index(0) if 0 in mask[start:] else len(mask) - start)
        return ids[start:end]

    return reply


def test_greedy_player_scores_demonstrated_outputs(template, demos):
    for demo in (next(d for d in demos if d.calls_tool), next(d for d in demos if not d.calls_tool)):
        engine = ScriptedEngine(demonstrated_turns(demo))
        result = asyncio.run(_play(engine, template, demo.problem, max_new_tokens=64, max_calls=3))
        assert result.success and result.called_tool == demo.calls_tool
        assert engine.calls == result.model_calls == (2 if demo.calls_tool else 1)


def test_warm_start_writes_a_loadable_checkpoint_and_reuses_it(tmp_path):
    torch.set_num_threads(1)
    out, meta = warm_start(tmp_path / "ws", TINY, seed=1)
    assert meta["complete"] and meta["steps_done"] == 2 and meta["key"] == warm_start_key(TINY, 1)
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", META_FILE} <= files
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == 9
    load_pretrained(out)
    ChatTemplate.from_pretrained(out)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    again, meta_again = warm_start(tmp_path / "ws", TINY, seed=1)
    assert time.perf_counter() - start < 0.5 and meta_again == meta
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp
    assert warm_start_key(TINY, 2) != meta["key"] != warm_start_key(replace(TINY, tool_fraction=0.1), 1)
    assert warm_start_key(replace(TINY, max_minutes=1.0), 1) == meta["key"]  # the budget is not a setting


def test_warm_start_refuses_a_foreign_directory(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a warm start"):
        warm_start(tmp_path, TINY, seed=0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--minutes", "0"], "--minutes"),
        (["--minutes", "-2"], "--minutes"),
        (["--seed", "-1"], "--seed"),
    ],
)
def test_cli_bad_arguments_exit_2(tmp_path, capsys, argv, message):
    assert main(["warm-start", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warm-start: error:") and message in err[0]
    assert not (tmp_path / "out").exists()


def test_cli_out_dir_that_is_a_file_exits_2(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["warm-start", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a directory" in err[0]


def test_cli_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["warm-start"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        main(["warm-start", "x", "--minutes", "soon"])
    assert exit_info.value.code == 2


def test_cli_reuses_a_finished_warm_start(tmp_path, capsys, monkeypatch):
    import gyre.tasks.demo.warm_start as module

    monkeypatch.setattr(module, "WarmStartConfig", lambda **kw: replace(TINY, **kw))
    assert main(["warm-start", str(tmp_path / "ws"), "--seed", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert Path(lines[0]) == (tmp_path / "ws").resolve()
    first = json.loads(lines[1])
    assert first["complete"] and not first["reused"]
    assert main(["warm-start", str(tmp_path / "ws"), "--seed", "3"]) == 0
    second = json.loads(capsys.readouterr().out.strip().splitlines()[1])
    assert second["reused"] and second["key"] == first["key"]


def test_a_run_cut_by_its_budget_is_reused_only_by_budgets_no_larger(tmp_path):
    torch.set_num_threads(1)
    cut = replace(TINY, max_minutes=1e-9)  # spent before the first step
    _, meta = warm_start(tmp_path / "ws", cut, seed=0)
    assert not meta["complete"] and meta["steps_done"] == 0
    assert warm_start(tmp_path / "ws", cut, seed=0)[1] == meta  # same budget: reused
    _, meta_full = warm_start(tmp_path / "ws", TINY, seed=0)  # larger budget: trained again, in place
    assert meta_full["complete"] and meta_full["steps_done"] == 2 and meta_full["key"] == meta["key"]


WAITER = """
import json, sys
from gyre.tasks.demo.warm_start import WarmStartConfig, warm_start_dir
print(warm_start_dir(sys.argv[1], WarmStartConfig(**json.loads(sys.argv[2])), seed=0), flush=True)
"""


def holds(pid: int, path: str) -> bool:
    fds = Path(f"/proc/{pid}/fd")
    try:
        return any(os.readlink(fd) == path for fd in fds.iterdir())
    except OSError:
        return False


def test_a_process_asking_while_another_trains_waits_and_reuses_its_warm_start(tmp_path):
    """warm_start_dir's lock: while the lock is held (here by the test, standing in for a process training), another
    process asking for the same warm start makes no staging directory of its own; once the holder has put a
    finished warm start in place and let go, the waiter returns it without training."""
    import fcntl
    import subprocess
    import sys

    from gyre.tasks.demo.warm_start import CACHE_PREFIX, read_meta

    root = tmp_path / "cache"
    root.mkdir()
    target = root / f"{CACHE_PREFIX}{warm_start_key(TINY, 0)}"
    with open(root / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = subprocess.Popen(
            [sys.executable, "-c", WAITER, str(root), json.dumps(asdict(TINY))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60  # until the waiter has the lock file open: it is in (or at) flock
            while time.monotonic() < deadline and waiter.poll() is None and not holds(waiter.pid, lock.name):
                time.sleep(0.1)
            time.sleep(0.5)
            assert waiter.poll() is None, waiter.communicate()
            assert [p.name for p in root.iterdir() if "staging" in p.name] == []  # it waits, it does not train
            _, meta = warm_start(target, TINY, seed=0)  # the holder's finished warm start
        except BaseException:
            waiter.kill()
            raise
    out, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 0, err[-2000:]
    assert Path(out.strip()) == target and read_meta(target) == meta  # the holder's, not trained again
