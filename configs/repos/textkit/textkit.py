"""Small text utilities: the repository `configs/rl-coding-tiny.yaml` makes feature-deletion tasks from."""


def word_count(text):
    """The number of whitespace-separated words in `text`."""
    words = text.split()
    count = len(words)
    return count


def capitalize_words(text):
    """Each word of `text` with its first letter upper-case."""
    parts = text.split(" ")
    capitalized = [p[:1].upper() + p[1:] for p in parts]
    return " ".join(capitalized)


def is_palindrome(text):
    """Whether `text` reads the same backwards, ignoring case and spaces."""
    letters = [c.lower() for c in text if not c.isspace()]
    backwards = letters[::-1]
    return letters == backwards


def char_histogram(text):
    """{character: count} of the non-space characters of `text`."""
    counts = {}
    for c in text:
        if not c.isspace():
            counts[c] = counts.get(c, 0) + 1
    return counts


def truncate(text, width):
    """`text` cut to `width` characters, ending with '...' when it was cut."""
    if len(text) <= width:
        return text
    return text[:max(width - 3, 0)] + "..."
