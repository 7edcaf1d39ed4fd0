"""Text helpers."""


def slugify(text):
    raise NotImplementedError


def shout(text):
    return text.upper() + "!"
