import pytest
from stack import Stack


def test_pop_returns_the_last_item_pushed():
    s = Stack()
    s.push(1)
    s.push(2)
    assert s.pop() == 2


def test_pop_of_an_empty_stack_raises_index_error():
    with pytest.raises(IndexError, match="empty stack"):
        Stack().pop()
