"""Roman numerals."""

SYMBOLS = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]


def to_roman(n):
    """n (1..3999) as a Roman numeral."""
    out = ""
    for value, symbol in SYMBOLS:
        while n >= value:
            out += symbol
            n -= value
    return out
