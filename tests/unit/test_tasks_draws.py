"""Training tasks drawn without replacement (`gyre.tasks.draws.TaskDeck`, issue 29): each task once per epoch in a
seeded order, and a resumed run draws what the interrupted one would have."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre.tasks.draws import TaskDeck


@given(num_tasks=st.integers(1, 40), draws=st.integers(0, 200), seed=st.integers(0, 2**32))
def test_every_task_once_per_epoch(num_tasks, draws, seed):
    deck = TaskDeck(num_tasks, random.Random(seed))
    drawn = [deck.draw() for _ in range(draws)]
    for start in range(0, draws, num_tasks):
        epoch = drawn[start : start + num_tasks]
        assert len(set(epoch)) == len(epoch) and all(0 <= i < num_tasks for i in epoch)
    assert deck.epoch == -(-draws // num_tasks)


@given(num_tasks=st.integers(1, 30), before=st.integers(0, 90), after=st.integers(1, 60), seed=st.integers(0, 99))
def test_a_restored_deck_draws_what_the_interrupted_one_would_have(num_tasks, before, after, seed):
    """The state travels as JSON with the RNG's (the controller's checkpoint keeps both)."""
    straight = TaskDeck(num_tasks, random.Random(seed))
    expected = [straight.draw() for _ in range(before + after)][before:]
    interrupted = TaskDeck(num_tasks, random.Random(seed))
    for _ in range(before):
        interrupted.draw()
    saved = json.loads(json.dumps({"deck": interrupted.state(), "rng": list(interrupted.rng.getstate()[1])}))
    rng = random.Random()
    version, _, gauss = interrupted.rng.getstate()
    rng.setstate((version, tuple(saved["rng"]), gauss))
    resumed = TaskDeck(num_tasks, rng)
    assert resumed.restore(saved["deck"])
    assert [resumed.draw() for _ in range(after)] == expected


def test_a_state_of_another_task_set_starts_a_new_epoch():
    deck = TaskDeck(5, random.Random(0))
    deck.draw()
    other = TaskDeck(3, random.Random(0))
    assert not other.restore(deck.state())
    assert sorted(other.draw() for _ in range(3)) == [0, 1, 2]
    with pytest.raises(ValueError, match="num_tasks=0"):
        TaskDeck(0, random.Random(0))
