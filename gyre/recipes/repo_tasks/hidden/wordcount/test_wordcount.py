from wordcount import count_words


def test_counts_plain_words():
    assert count_words("a b a") == {"a": 2, "b": 1}


def test_ignores_case():
    assert count_words("The the THE") == {"the": 3}


def test_ignores_punctuation():
    assert count_words("hi, hi! hi.") == {"hi": 3}
