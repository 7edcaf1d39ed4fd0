"""Provisioning of the claude_code and codex harnesses in a training run (`gyre.runtime.job.harness_setup`,
docs/harness.md "Provisioning"): the config's instructions and settings files are read and checked once at start
(one line naming the field for a file that is missing, not UTF-8, not a JSON object for Claude Code, or TOML Codex's
config cannot hold), and a task's `metadata.instructions` follows the config's."""

from __future__ import annotations

import pytest
from test_tasks_spec import GOOD, make_task

from gyre.config.harness import HarnessConfig
from gyre.runtime.job.harness_setup import HarnessSetupError, harness_provisioning, make_runner
from gyre.tasks.spec import load_task


def test_instructions_and_settings_reach_the_runner_with_the_tasks_own(tmp_path):
    (tmp_path / "CLAUDE.md").write_text("Always run pytest.\n")
    (tmp_path / "settings.json").write_text('{"permissions": {"allow": ["Bash"]}}')
    harness = HarnessConfig(
        name="claude_code", instructions_file=str(tmp_path / "CLAUDE.md"), settings_file=str(tmp_path / "settings.json")
    )
    provisioning = harness_provisioning(harness)
    task = load_task(make_task(tmp_path / "tasks", GOOD + '\ninstructions = "The bug is in calc.py."\n'))
    runner = make_runner(harness, task, provisioning)
    assert runner.instructions == "Always run pytest.\n\nThe bug is in calc.py.\n"
    assert runner.settings == '{"permissions": {"allow": ["Bash"]}}'
    plain = make_runner(HarnessConfig(name="codex"), load_task(make_task(tmp_path / "t2", GOOD)))
    assert (plain.instructions, plain.settings) == ("", "")


@pytest.mark.parametrize(
    ("name", "field", "content", "says"),
    [
        ("claude_code", "settings_file", "[1, 2]", "expected a JSON object"),
        ("claude_code", "settings_file", "{nope", "not JSON"),
        ("codex", "settings_file", 'model = "other"\n', "may not set model"),
        ("codex", "settings_file", "= broken", "not TOML"),
        ("claude_code", "instructions_file", b"\xff\xfe bad", "cannot be read as UTF-8"),
        ("builtin", "instructions_file", "hello", "only the claude_code and codex harnesses take it"),
        ("claude_code", "instructions_file", None, "cannot be read"),  # missing
    ],
)
def test_a_bad_file_is_one_line_naming_the_field(tmp_path, name, field, content, says):
    path = tmp_path / "file"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(HarnessSetupError) as error:
        harness_provisioning(HarnessConfig(name=name, **{field: str(path)}))
    assert str(error.value).startswith(f"harness.{field}=") and says in str(error.value), error.value
    assert "\n" not in str(error.value)
