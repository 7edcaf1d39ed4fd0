"""Training tasks drawn without replacement: every task once per epoch, in a seeded order (docs/runtime.md, "Tasks and
the held-out evaluation").

`TaskDeck(num_tasks, rng)`: `draw()` returns the next task index of the current epoch, a seeded shuffle of
`range(num_tasks)` made with `rng` when the epoch before is used up. `state()` / `restore(state)` keep the epoch's
remaining order (and the epoch count) in a JSON-ready dict, so a resumed run draws what the interrupted one would
have; a state from another task count (the task set changed) starts a new epoch instead. Pure: stdlib only.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["TaskDeck"]


class TaskDeck:
    """Task indices in `[0, num_tasks)`, each once per epoch (module docstring)."""

    def __init__(self, num_tasks: int, rng: random.Random):
        if not isinstance(num_tasks, int) or num_tasks < 1:
            raise ValueError(f"num_tasks={num_tasks!r}: expected an int >= 1")
        self.num_tasks = num_tasks
        self.rng = rng
        self.epoch = 0  # epochs begun
        self._left: list[int] = []  # the current epoch's indices not drawn yet, next last

    def draw(self) -> int:
        if not self._left:
            order = list(range(self.num_tasks))
            self.rng.shuffle(order)
            self._left = order[::-1]
            self.epoch += 1
        return self._left.pop()

    def state(self) -> dict[str, Any]:
        return {"num_tasks": self.num_tasks, "epoch": self.epoch, "left": list(self._left)}

    def restore(self, state: dict[str, Any]) -> bool:
        """Take the epoch `state` was in; False (and a new epoch at the next draw) if it was of another task count."""
        left = [int(i) for i in state.get("left", [])]
        if state.get("num_tasks") != self.num_tasks or not all(0 <= i < self.num_tasks for i in left):
            self._left = []
            return False
        self.epoch, self._left = int(state.get("epoch", 0)), left
        return True
