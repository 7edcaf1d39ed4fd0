"""Word counts of a text."""


def count_words(text):
    """How many times each word occurs, case-insensitively, punctuation ignored."""
    counts = {}
    for word in text.split():
        counts[word] = counts.get(word, 0) + 1
    return counts
