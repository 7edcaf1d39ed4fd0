"""gyre's builtin reference harness: a separate process (`python -m gyre.harness.builtin`) on the official
`anthropic` (default) or `openai` SDK, talking only to the base URL and key in its environment.

`gyre.harness.builtin.runner.BuiltinRunner` starts it for an execution; `agent` holds the loop (tools, compaction,
sub-agents, retries), `tools` the workspace tools. See docs/builtin-harness.md. Importing the package imports
neither SDK.
"""
