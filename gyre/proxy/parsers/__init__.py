"""Output dialects of the models: how each writes tool calls and marks its reasoning, selected by name.

`registry.py` maps SGLang's `--tool-call-parser` and `--reasoning-parser` names to factories; one small module per
tool-call dialect (`hermes.py`, `qwen3_coder.py`, `llama3.py`) and one for the reasoning tags (`reasoning.py`).
`gyre.proxy.output.OutputParser` chains a reasoning parser and a tool-call parser (`base.py`: their contracts).
Pure: stdlib only, no IO except a warning logged for each tool call returned as text.
"""
