import pytest
from inventory import Inventory


def test_add_and_count():
    inventory = Inventory()
    inventory.add("apple", 3)
    assert inventory.count("apple") == 3


def test_remove_some():
    inventory = Inventory()
    inventory.add("apple", 3)
    inventory.remove("apple", 2)
    assert inventory.count("apple") == 1


def test_remove_too_many_raises_and_keeps_the_stock():
    inventory = Inventory()
    inventory.add("apple", 1)
    with pytest.raises(ValueError):
        inventory.remove("apple", 2)
    assert inventory.count("apple") == 1


def test_remove_unknown_item_raises():
    with pytest.raises(ValueError):
        Inventory().remove("pear", 1)
