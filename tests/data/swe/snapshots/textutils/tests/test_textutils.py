from textutils import shout, slugify


def test_slugify_lowercases_and_joins_words():
    assert slugify("Hello World") == "hello-world"


def test_slugify_drops_punctuation():
    assert slugify("Ready, set: go!") == "ready-set-go"


def test_shout():
    assert shout("hi") == "HI!"
