from intervals import length, merge


def test_length():
    assert length([2, 5]) == 3


def test_merge_overlapping():
    assert merge([[1, 3], [2, 6], [8, 10]]) == [[1, 6], [8, 10]]


def test_merge_unsorted_and_touching():
    assert merge([[5, 7], [1, 5]]) == [[1, 7]]


def test_merge_empty():
    assert merge([]) == []
