import pytest
from roman import to_roman


def test_additive_numerals():
    assert (to_roman(3), to_roman(8), to_roman(2023)) == ("III", "VIII", "MMXXIII")


def test_subtractive_four_and_nine():
    assert (to_roman(4), to_roman(9), to_roman(40), to_roman(90)) == ("IV", "IX", "XL", "XC")


def test_subtractive_hundreds():
    assert (to_roman(400), to_roman(900), to_roman(1994)) == ("CD", "CM", "MCMXCIV")


def test_out_of_range():
    with pytest.raises(ValueError):
        to_roman(0)
