"""Config of the bundled demo task family (`gyre.tasks.demo`): expression difficulty and episode shape.

Composed by `WarmStartConfig` (the problems its demonstrations show) and by whatever generates demo tasks.
Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre.config.checks import require, require_bool, require_duration, require_int, require_number

DEMO_OPERATORS = "+-*"


MAX_CONTEXT_WORDS = 1_000_000  # a bound on DemoConfig.context_words (a model's context is the real limit)
WORK_TIME_SCALE = 400.0  # the nl2repo_122b workload's hours as seconds: 1.93 h -> ~17 s a mean execution


@dataclass(kw_only=True)
class DemoWorkConfig:
    """Slow executions (docs/tasks.md, "Slow executions"): after its final answer, the builtin harness runs the
    task's check command, which takes a duration drawn per execution from the paper's NL2Repo shape, so an
    execution spends most of its time in a command that really runs, as a build or a test suite would. The
    defaults are `conf/workload/nl2repo_122b.yaml` with every time divided by 400 (a mean execution ~17 s).
    """

    enabled: bool = False
    """Off: the plain demo (an episode takes seconds)."""
    median_s: float = 6000.0 / WORK_TIME_SCALE
    """Median raw duration of the check command (log-normal)."""
    sigma: float = 0.3
    """Log-space standard deviation of the per-execution factor."""
    query_sigma: float = 0.4
    """Log-space standard deviation of the per-task factor a group's executions share."""
    harness_timeout_s: float = 12600.0 / WORK_TIME_SCALE
    """The task's harness budget (replaces harness_timeout_s): past it the harness is stopped and the answer it
    left is scored (a harness timeout, trained on)."""
    overall_timeout_s: float = 16200.0 / WORK_TIME_SCALE
    """The task's overall budget (replaces overall_timeout_s): an execution past it is discarded."""
    overall_timeout_share: float = 0.1222
    """Share of the over-budget executions whose evaluation hangs until the overall budget (a stuck evaluation)."""
    eval_s: float = 300.0 / WORK_TIME_SCALE
    """Mean of the evaluation's duration (exponential)."""

    def __post_init__(self) -> None:
        require_bool("tasks.demo.work.enabled", self.enabled)
        require_duration("tasks.demo.work.median_s", self.median_s)
        require_number("tasks.demo.work.sigma", self.sigma, ge=0, le=3)
        require_number("tasks.demo.work.query_sigma", self.query_sigma, ge=0, le=3)
        require_duration("tasks.demo.work.harness_timeout_s", self.harness_timeout_s)
        require_duration("tasks.demo.work.overall_timeout_s", self.overall_timeout_s)
        require(
            self.overall_timeout_s > self.harness_timeout_s,
            "tasks.demo.work.overall_timeout_s",
            self.overall_timeout_s,
            f"more than tasks.demo.work.harness_timeout_s ({self.harness_timeout_s:g})",
        )
        require_number("tasks.demo.work.overall_timeout_share", self.overall_timeout_share, ge=0, le=1)
        require_duration("tasks.demo.work.eval_s", self.eval_s, allow_zero=True)


@dataclass(kw_only=True)
class DemoConfig:
    """Difficulty knobs and episode shape of the demo family."""

    num_operands: int = 2
    """Numbers per expression (2: "a * b"; 3+: "a + b * c", precedence matters)."""
    min_digits: int = 1
    """Each operand has between min_digits and max_digits digits (uniform in the count)."""
    max_digits: int = 4
    """4 digits: products a tiny model cannot guess, trivial for the tool (at most 12)."""
    operators: str = "+-*"
    """Drawn uniformly per position, a non-empty subset of '+-*'; '*' is where the tool pays."""
    parentheses: bool = False
    """With 3+ operands, half the expressions group their first two operands."""
    prompt_template: str = "What is {expression}?"
    """The user prompt; a few dozen tokens at most; must contain {expression}."""
    answer_file: str = "answer.txt"
    """Where the answer must end up in the workspace (a plain file name)."""
    harness_timeout_s: float = 60.0
    """A demo episode takes seconds; past this the answer file is scored as is."""
    overall_timeout_s: float = 120.0
    """Harness + evaluation budget of one demo task (>= harness_timeout_s)."""
    id_prefix: str = "demo"
    """Task ids are `<id_prefix>-<seed>-<index>`."""
    context_words: int = 0
    """Words of reference notes after the system prompt of every call (arithmetic facts, fixed per task): the long
    prefix a real harness sends (Claude Code's system prompt and tools are ~48K tokens) in the demo, so rows grow
    by ~3 tokens a word (numbers split in the tiny vocabulary) and training weighs as on real rows. 0: none."""
    work: DemoWorkConfig = field(default_factory=DemoWorkConfig)
    """Slow executions (off by default); when on, its budgets replace the two timeouts above."""

    def __post_init__(self) -> None:
        require_int("DemoConfig.num_operands", self.num_operands, ge=2)
        require_int("DemoConfig.min_digits", self.min_digits, ge=1, le=12)
        require_int("DemoConfig.max_digits", self.max_digits, ge=1, le=12)
        require(
            self.min_digits <= self.max_digits,
            "DemoConfig.min_digits",
            self.min_digits,
            f"an integer <= max_digits ({self.max_digits})",
        )
        require(
            isinstance(self.operators, str)
            and len(self.operators) > 0
            and all(op in DEMO_OPERATORS for op in self.operators),
            "DemoConfig.operators",
            self.operators,
            f"a non-empty subset of {DEMO_OPERATORS!r}",
        )
        require_bool("DemoConfig.parentheses", self.parentheses)
        require(
            isinstance(self.prompt_template, str) and "{expression}" in self.prompt_template,
            "DemoConfig.prompt_template",
            self.prompt_template,
            "a template containing {expression}",
        )
        require(
            isinstance(self.answer_file, str)
            and bool(self.answer_file)
            and "/" not in self.answer_file
            and not self.answer_file.startswith("."),
            "DemoConfig.answer_file",
            self.answer_file,
            "a plain file name (no '/', not starting with '.')",
        )
        require_duration("DemoConfig.harness_timeout_s", self.harness_timeout_s)
        require_duration("DemoConfig.overall_timeout_s", self.overall_timeout_s)
        require(
            self.harness_timeout_s <= self.overall_timeout_s,
            "DemoConfig.harness_timeout_s",
            self.harness_timeout_s,
            f"a number <= overall_timeout_s ({self.overall_timeout_s:g})",
        )
        require_int("DemoConfig.context_words", self.context_words, ge=0, le=MAX_CONTEXT_WORDS)
        require(
            isinstance(self.id_prefix, str) and bool(self.id_prefix) and "/" not in self.id_prefix,
            "DemoConfig.id_prefix",
            self.id_prefix,
            "a non-empty name without '/'",
        )
