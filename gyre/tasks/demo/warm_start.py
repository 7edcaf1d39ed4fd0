"""Supervised warm start of the tiny default model on demonstrations of the demo family, and its greedy evaluation.

RL from a random-init tiny model never finds the calculator: the policy needs a starting point that already
speaks the chat format and calls the tool sometimes, but not so often that RL has nothing left to learn
(docs/warm-start.md, "The prototype"). `warm_start(out_dir, config, seed)` trains the tiny
model on a mix of demonstrations: those of problems using a `tool_operators` operator (default: products), and a
fraction `tool_fraction` (default 10%) of the others, show the rewarded behavior (call the calculator, then answer
with its value); the rest answer directly with the exact value, which a 1.7M-parameter model cannot learn in
minutes, so its own direct answers are guesses. Greedy, the result solves the products (~1/3 of the problems);
sampled, it calls the tool on a few percent of the rest, which is what RL can reinforce.

Contract:
- Episodes are rendered exactly as the proxy renders them at RL time: a `ChatRequest` (system = the demo's
  `SYSTEM_PROMPT`, tools = [the calculator], user = the task prompt) through `PromptBuilder`; the tool-call turn
  is the ids the model would sample, remembered in the `PayloadCache` and restored (SAMPLED) in the next request,
  as the proxy does with a harness's echo. The loss mask is 1 on exactly the sampled assistant tokens (each
  assistant turn's ids through its stop token `<|im_end|>`), 0 elsewhere.
- Deterministic in `seed` (data, init, order of batches); the output is an HF-layout directory
  (`save_pretrained` + the base model's tokenizer files) that `load_pretrained`, `ChatTemplate.from_pretrained`
  and `gyre.serve` (`model.path=...`) load like the tiny model, plus `warm_start.json` (settings, key, losses).
- Cached: `warm_start(out_dir, ...)` returns at once when `out_dir` already holds a finished warm start with the
  same key (settings + seed + base model + gyre version); `warm_start_dir()` keeps one under the gyre cache root.
- `max_minutes` is a wall-clock budget: training stops early when it runs out (recorded as `complete: false`).
- `evaluate_greedy(model_dir, problems)` plays each episode as the harness + proxy would, greedily, with the
  native engine, and scores the final answer with the demo check.
Torch is imported inside the functions that need it. CLI: `python -m gyre.tasks.demo warm-start OUT_DIR`
(`gyre/tasks/demo/__main__.py`). See docs/warm-start.md.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gyre
from gyre.config.checks import is_int
from gyre.config.warm_start import WarmStartConfig
from gyre.models.model_files import CONFIG_FILE, TOKENIZER_FILES, default_cache_root
from gyre.models.tiny import spec_hash, tiny_model_dir
from gyre.proxy.conversation import ChatRequest, ToolSpec, Turn
from gyre.proxy.output import OutputDecoder
from gyre.proxy.payload import PayloadCache
from gyre.proxy.render import ChatTemplate, PromptBuilder
from gyre.tasks.demo import SYSTEM_PROMPT, DemoProblem, make_demo_problems
from gyre.tasks.demo.calculator import CALCULATOR_TOOL_SPEC
from gyre.tasks.demo.calculator import call as calculator_call
from gyre.tasks.demo.check import read_answer
from gyre.traj.record import Provenance

logger = logging.getLogger(__name__)

META_FILE = "warm_start.json"
CACHE_PREFIX = "warm-"
FORMAT = 1  # bump when the output changes for the same key in a way the key does not capture
CALCULATOR = ToolSpec(
    name=CALCULATOR_TOOL_SPEC["name"],
    description=CALCULATOR_TOOL_SPEC["description"],
    parameters=CALCULATOR_TOOL_SPEC["input_schema"],
)


# ----------------------------------------------------------------------------- demonstrations


@dataclass(frozen=True, eq=False)
class Demonstration:
    """One rendered episode: the ids the trainer sees and a 0/1 mask of the sampled assistant tokens."""

    problem: DemoProblem
    calls_tool: bool
    input_ids: list[int]
    loss_mask: list[int]  # 1: a token the policy sampled (assistant turns, stop tokens included)


def demo_request(problem: DemoProblem, turns: Sequence[Turn] = ()) -> ChatRequest:
    """The request the builtin harness sends for `problem`: system prompt, the calculator, the user prompt, `turns`."""
    return ChatRequest(
        dialect="openai_chat",
        model="gyre-tiny",
        system=SYSTEM_PROMPT,
        turns=(Turn(role="user", text=problem.prompt), *turns),
        tools=(CALCULATOR,),
    )


def assistant_output_ids(template: ChatTemplate, message: dict[str, Any]) -> list[int]:
    """The ids a model samples for the assistant `message`: its rendering between the generation prompt and the
    template's footer, through the stop token (what `PromptBuilder` encodes for an assistant turn)."""
    user = [{"role": "user", "content": "x"}]
    head = template.render(user, add_generation_prompt=True)
    full = template.render([*user, message])
    footer = template.assistant_footer
    if not (footer and full.startswith(head) and full.endswith(footer)):
        raise ValueError("the chat template does not frame an assistant turn as generation prompt + body + footer")
    return template.encode(full[len(head) : len(full) - len(footer)] + template.footer_stop_text)


def parse_output(template: ChatTemplate, output_ids: Sequence[int], finish: str, call_prefix: str):
    """The proxy's parse of output ids (`OutputDecoder`, stop ids skipped) -> `AssistantOutput`."""
    counter = iter(range(1_000_000))
    decoder = OutputDecoder(
        template.tokenizer, skip_ids=template.end_of_turn_ids, new_call_id=lambda: f"{call_prefix}-{next(counter)}"
    )
    decoder.feed(list(output_ids))
    return decoder.finish(finish)[1]


def run_tools(output) -> list[Turn]:
    """The harness's tool turns for an output's calls (the demo's calculator; other names get its error text)."""
    turns = []
    for call in output.tool_calls:
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            arguments = None
        turns.append(Turn(role="tool", text=calculator_call(call.name, arguments), tool_call_id=call.id))
    return turns


def render_demonstration(template: ChatTemplate, problem: DemoProblem, *, calls_tool: bool) -> Demonstration:
    """One episode rendered as the proxy would at RL time (module docstring)."""
    builder = PromptBuilder(template, PayloadCache())
    first = builder.build(demo_request(problem))
    answer = str(problem.answer)
    if not calls_tool:
        output_ids = assistant_output_ids(template, {"role": "assistant", "content": answer})
        ids = [*first.input_ids, *output_ids]
        return Demonstration(problem, False, ids, [0] * len(first.input_ids) + [1] * len(output_ids))
    call_message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "calculator", "arguments": {"expression": problem.expression}}],
    }
    call_ids = assistant_output_ids(template, call_message)
    output = parse_output(template, call_ids, "stop", f"call-{problem.id}")
    if len(output.tool_calls) != 1:
        raise ValueError(f"the proxy does not parse the demonstrated tool call of {problem.id} as one call")
    builder.payloads.remember(output, call_ids)
    echoed = Turn(role="assistant", text=output.text, tool_calls=output.tool_calls)
    second = builder.build(demo_request(problem, (echoed, *run_tools(output))))
    answer_ids = assistant_output_ids(template, {"role": "assistant", "content": answer})
    ids = [*second.input_ids, *answer_ids]
    mask: list[int] = []
    for segment in second.segments:
        mask.extend([1 if segment.provenance is Provenance.SAMPLED else 0] * len(segment))
    mask.extend([1] * len(answer_ids))
    # TITO: the second prompt extends the first prompt and our sampled call, token for token.
    assert ids[: len(first.input_ids) + len(call_ids)] == [*first.input_ids, *call_ids], problem.id
    assert sum(mask) == len(call_ids) + len(answer_ids), problem.id
    return Demonstration(problem, True, ids, mask)


def uses_tool_operator(problem: DemoProblem, operators: str) -> bool:
    """Whether `problem`'s expression applies one of `operators` (operands are non-negative: no unary minus)."""
    return any(f" {op} " in problem.expression for op in operators)


def make_demonstrations(
    template: ChatTemplate, n: int, seed: int, config: WarmStartConfig | None = None
) -> list[Demonstration]:
    """`n` demonstrations of problems `make_demo_problems(n, seed)`. Problems using a `tool_operators` operator call
    the tool; of the others exactly round(count * tool_fraction), chosen by `random.Random(seed)`, do too, and the
    rest answer directly. Deterministic in (n, seed, config)."""
    config = config or WarmStartConfig()
    problems = make_demo_problems(n, seed, config.demo)
    always = {i for i, p in enumerate(problems) if uses_tool_operator(p, config.tool_operators)}
    others = [i for i in range(n) if i not in always]
    with_tool = always | set(random.Random(seed).sample(others, round(len(others) * config.tool_fraction)))
    return [render_demonstration(template, p, calls_tool=i in with_tool) for i, p in enumerate(problems)]


# ----------------------------------------------------------------------------- training


def _lr_at(step: int, config: WarmStartConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def shared_prefix_len(demos: Sequence[Demonstration]) -> int:
    """Tokens every demonstration starts with and none is trained on (system prompt and tools: ~280 tokens)."""
    first = demos[0].input_ids
    n = min(len(d.input_ids) for d in demos) - 1
    for demo in demos:
        i = 0
        while i < n and demo.input_ids[i] == first[i] and not demo.loss_mask[i + 1]:
            i += 1
        n = i
    return n


def masked_loss(model, batch: Sequence[Demonstration], prefix: int, pad_id: int):
    """Mean next-token cross-entropy over the masked tokens of `batch`, whose first `prefix` tokens are shared and
    untrained (`shared_prefix_len`): the prefix is computed once and its keys and values are broadcast to every row,
    which gives the loss and gradients of full rows (~4x cheaper with the ~300-token system and tools header).
    Rows are padded per length bucket: episodes with a tool call are ~3x longer than direct answers."""
    import torch
    import torch.nn.functional as F

    from gyre.models.decoder import KVCache

    cache_1 = None
    if prefix:
        _, cache_1 = model(torch.tensor([batch[0].input_ids[:prefix]]), torch.arange(prefix)[None])
    total = torch.zeros(())
    count = 0
    for bucket in ([d for d in batch if d.calls_tool], [d for d in batch if not d.calls_tool]):
        if not bucket:
            continue
        B, T = len(bucket), max(len(d.input_ids) - prefix for d in bucket)
        ids_BT = torch.full((B, T), pad_id, dtype=torch.long)
        mask_BT = torch.zeros((B, T), dtype=torch.bool)
        for b, demo in enumerate(bucket):
            assert demo.input_ids[:prefix] == batch[0].input_ids[:prefix] and not any(demo.loss_mask[: prefix + 1])
            n = len(demo.input_ids) - prefix
            ids_BT[b, :n] = torch.tensor(demo.input_ids[prefix:])
            mask_BT[b, :n] = torch.tensor(demo.loss_mask[prefix:], dtype=torch.bool)
        cache = None
        if cache_1 is not None:
            cache = KVCache(
                tuple(k.expand(B, -1, -1, -1) for k in cache_1.keys),
                tuple(v.expand(B, -1, -1, -1) for v in cache_1.values),
            )
        positions_BT = torch.arange(prefix, prefix + T)[None].expand(B, T)
        logits_BTV, _ = model(ids_BT, positions_BT, kv_cache=cache)
        target_mask_BT = mask_BT[:, 1:]  # logits at t predict token t + 1
        total = total + F.cross_entropy(
            logits_BTV[:, :-1][target_mask_BT], ids_BT[:, 1:][target_mask_BT], reduction="sum"
        )
        count += int(target_mask_BT.sum())
    return total / count


def train_steps(model, demos: Sequence[Demonstration], config: WarmStartConfig, seed: int, pad_id: int) -> dict:
    """AdamW on `masked_loss` over batches drawn with replacement (seeded); stops early when `max_minutes` is spent."""
    import torch

    prefix = shared_prefix_len(demos)
    generator = torch.Generator().manual_seed(seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, 0.95),
    )
    model.train()
    start = time.perf_counter()
    cpu_start = time.process_time()
    budget_s = config.max_minutes * 60
    losses: list[float] = []
    step = 0
    log_every = max(1, config.steps // 20)
    while step < config.steps:
        if time.perf_counter() - start > budget_s:
            logger.warning(
                "warm start: time budget of %g min spent after %d/%d steps", config.max_minutes, step, config.steps
            )
            break
        rows = torch.randint(len(demos), (config.batch_size,), generator=generator).tolist()
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, config)
        loss = masked_loss(model, [demos[r] for r in rows], prefix, pad_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        if step % log_every == 0 or step == config.steps:
            recent = losses[-log_every:]
            logger.info(
                "warm start: step %d/%d loss %.4f lr %.2e elapsed %.1fs",
                step,
                config.steps,
                sum(recent) / len(recent),
                _lr_at(step - 1, config),
                time.perf_counter() - start,
            )
    model.eval()
    return {
        "steps_done": step,
        "complete": step == config.steps,
        "shared_prefix_tokens": prefix,
        "first_loss": round(losses[0], 4) if losses else None,
        "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4) if losses else None,
        "train_seconds": round(time.perf_counter() - start, 2),
        "train_cpu_seconds": round(time.process_time() - cpu_start, 2),
    }


# ----------------------------------------------------------------------------- the checkpoint


def warm_start_key(config: WarmStartConfig, seed: int, base_dir: str | Path | None = None) -> str:
    """16 hex digits: settings, seed, base model (tiny spec hash or directory), gyre's version, and the source of
    what shapes the demonstrations and the training: this file, the demo family, the proxy's rendering and output
    parsing, the native model (a change in any of them trains anew instead of reusing a stale checkpoint)."""
    base = spec_hash() if base_dir is None else str(Path(base_dir).resolve())
    digest = hashlib.sha256()
    payload = {"config": config.key_fields(), "seed": seed, "base": base, "gyre": gyre.__version__, "format": FORMAT}
    digest.update(json.dumps(payload, sort_keys=True, default=str).encode())
    for path in _key_sources():
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _key_sources() -> list[Path]:
    package = Path(gyre.__file__).parent
    demo = Path(__file__).parent  # this file and the demo family's modules
    # The CLI (__main__.py) trains nothing, and the slow executions' check (work.py) shapes no demonstration.
    paths = sorted(path for path in demo.glob("*.py") if path.name not in ("__main__.py", "work.py"))
    paths += [package / "proxy" / name for name in ("render.py", "template.py", "output.py", "payload.py")]
    return [*paths, package / "models" / "decoder.py"]


def read_meta(out_dir: str | Path) -> dict[str, Any] | None:
    path = Path(out_dir) / META_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        return None


def _reusable(out_dir: Path, key: str, budget_minutes: float) -> dict[str, Any] | None:
    meta = read_meta(out_dir)
    if meta is None or meta.get("key") != key or not (out_dir / "model.safetensors").is_file():
        return None
    # An incomplete run is reused only by callers whose budget is no larger than the one that cut it short.
    if meta.get("complete") or budget_minutes <= meta.get("max_minutes", 0):
        return meta
    return None


def warm_start(
    out_dir: str | Path,
    config: WarmStartConfig | None = None,
    seed: int = 0,
    *,
    base_dir: str | Path | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Train (or reuse) the warm start into `out_dir`; returns (out_dir, meta). `base_dir`: the model to start
    from (default: the cached tiny model). `out_dir` must be absent, empty, or an earlier warm start."""
    config = config or WarmStartConfig()
    if not is_int(seed) or seed < 0:
        raise ValueError(f"seed={seed!r}: expected an int >= 0")
    out = Path(out_dir)
    key = warm_start_key(config, seed, base_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {out} exists and is not a directory")
    meta = _reusable(out, key, config.max_minutes) if out.is_dir() else None
    if meta is not None:
        logger.info("warm start: reusing %s (key %s)", out, key)
        return out, meta
    if out.is_dir() and any(out.iterdir()) and read_meta(out) is None:
        raise ValueError(f"out_dir {out} holds files that are not a warm start; use an empty or new directory")

    import torch

    from gyre.models.hf_weights import load_pretrained, save_pretrained

    base = Path(base_dir) if base_dir is not None else tiny_model_dir()
    template = ChatTemplate.from_pretrained(base)
    render_start = time.perf_counter()
    demos = make_demonstrations(template, config.num_demos, seed, config)
    render_seconds = time.perf_counter() - render_start
    logger.info(
        "warm start: %d demonstrations (%d call the tool) rendered in %.1fs; %d steps of batch %d, lr %.1e",
        len(demos),
        sum(d.calls_tool for d in demos),
        render_seconds,
        config.steps,
        config.batch_size,
        config.lr,
    )
    torch.manual_seed(seed)
    model = load_pretrained(base)
    pad_id = json.loads((base / CONFIG_FILE).read_text()).get("pad_token_id", 0)
    stats = train_steps(model, demos, config, seed, pad_id)

    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, out)
    base_config = json.loads((base / CONFIG_FILE).read_text())
    hf_config = json.loads((out / CONFIG_FILE).read_text())
    if "pad_token_id" in base_config:
        hf_config["pad_token_id"] = base_config["pad_token_id"]
    (out / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(base / name, out / name)
    meta = {
        "key": key,
        "seed": seed,
        "settings": config.key_fields(),
        "max_minutes": config.max_minutes,
        "base": str(base),
        "gyre_version": gyre.__version__,
        "demonstrations": len(demos),
        "tool_demonstrations": sum(d.calls_tool for d in demos),
        "render_seconds": round(render_seconds, 2),
        **stats,
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return out, meta


def warm_start_dir(cache_root: str | Path | None = None, config: WarmStartConfig | None = None, seed: int = 0) -> Path:
    """`<cache_root>/warm-<key>` (default root: `$GYRE_CACHE` or ~/.cache/gyre), trained on first use. Built in a
    staging directory and renamed into place, so readers never see a partial checkpoint; one process trains it at a
    time (a lock file beside it), so processes that ask at once wait for it instead of each training their own."""
    config = config or WarmStartConfig()
    root = default_cache_root() if cache_root is None else Path(cache_root)
    target = root / f"{CACHE_PREFIX}{warm_start_key(config, seed)}"
    key = target.name.removeprefix(CACHE_PREFIX)
    if _reusable(target, key, config.max_minutes) is not None:
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        if _reusable(target, key, config.max_minutes) is not None:
            return target  # another process trained it while this one waited
        _build(target, config, seed)
    return target


def _build(target: Path, config: WarmStartConfig, seed: int) -> None:
    root = target.parent
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-{os.getpid()}-", dir=root))
    try:
        warm_start(staging, config, seed)
        if target.exists():  # an incomplete run with a smaller budget: replace it
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:
            if read_meta(target) is None:  # another builder won the race with a complete copy, or it failed
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# ----------------------------------------------------------------------------- greedy evaluation


@dataclass(frozen=True)
class EpisodeResult:
    problem_id: str
    success: bool
    called_tool: bool
    final_text: str
    model_calls: int


async def _play(
    engine,
    template: ChatTemplate,
    problem: DemoProblem,
    max_new_tokens: int,
    max_calls: int,
    temperature: float = 0.0,
    seed: int | None = None,
):
    from gyre.engine.protocol import GenerateRequest, SamplingParams

    builder = PromptBuilder(template, PayloadCache())
    params = SamplingParams(
        temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=template.end_of_turn_ids, seed=seed
    )
    turns: list[Turn] = []
    called_tool = False
    output = None
    for index in range(max_calls):
        prompt = builder.build(demo_request(problem, turns))
        request = GenerateRequest(
            request_id=f"{problem.id}-{index}", execution_id=problem.id, input_ids=prompt.input_ids, params=params
        )
        result = await engine.generate(request)
        output = parse_output(template, result.output_ids, result.finish_reason, f"{problem.id}-{index}")
        builder.payloads.remember(output, result.output_ids)
        if not output.tool_calls:
            break
        called_tool = True
        turns += [Turn(role="assistant", text=output.text, tool_calls=output.tool_calls), *run_tools(output)]
    final_text = output.text if output is not None and not output.tool_calls else ""
    success = read_answer(final_text) == problem.answer  # the demo check's rule on the answer file's text
    return EpisodeResult(problem.id, success, called_tool, final_text, index + 1)


async def _evaluate(model, template, problems, max_new_tokens, max_calls, max_running, temperature, seed):
    from gyre.engine.native import NativeEngine

    engine = NativeEngine(model, max_running=max_running)
    seeds = [None if temperature == 0 else seed * 100_003 + i for i in range(len(problems))]
    try:
        plays = (
            _play(engine, template, p, max_new_tokens, max_calls, temperature, s)
            for p, s in zip(problems, seeds, strict=True)
        )
        return list(await asyncio.gather(*plays))
    finally:
        await engine.close()


def evaluate_greedy(
    model_dir: str | Path,
    problems: Sequence[DemoProblem],
    *,
    max_new_tokens: int = 64,
    max_calls: int = 3,
    max_running: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Greedy success on `problems`, played as harness + proxy would: render with `PromptBuilder`, generate with
    the native engine, parse with the proxy's `OutputDecoder`, run the calculator on calls, repeat (at most
    `max_calls` model calls), score the final answer with the demo check. Returns rates and per-episode results.
    `temperature` > 0 samples instead (seeded per episode from `seed`): what RL's rollouts would see."""
    from gyre.models.hf_weights import load_pretrained

    template = ChatTemplate.from_pretrained(model_dir)
    model = load_pretrained(model_dir)
    return evaluate_greedy_model(
        model,
        template,
        problems,
        max_new_tokens=max_new_tokens,
        max_calls=max_calls,
        max_running=max_running,
        temperature=temperature,
        seed=seed,
    )


def evaluate_greedy_model(
    model,
    template: ChatTemplate,
    problems: Sequence[DemoProblem],
    *,
    max_new_tokens: int = 64,
    max_calls: int = 3,
    max_running: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
) -> dict[str, Any]:
    """`evaluate_greedy` on a loaded `DecoderLM` (not modified; the caller must not train it meanwhile) with its
    chat template: what a training run evaluates its held-out set with (docs/runtime.md). Runs its own event
    loop: call it from a thread without one (the controller uses `asyncio.to_thread`)."""
    results = asyncio.run(
        _evaluate(model, template, problems, max_new_tokens, max_calls, max_running, temperature, seed)
    )
    n = max(1, len(results))
    return {
        "episodes": len(results),
        "success_rate": round(sum(r.success for r in results) / n, 4),
        "tool_call_rate": round(sum(r.called_tool for r in results) / n, 4),
        "success_with_tool": sum(r.success and r.called_tool for r in results),
        "success_without_tool": sum(r.success and not r.called_tool for r in results),
        "results": results,
    }
