"""Small text utilities: the repository the tiny recipe makes its coding tasks from (feature deletion)."""


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


def reverse_words(text):
    """The words of `text` in reverse order, joined by single spaces."""
    words = text.split()
    words.reverse()
    return " ".join(words)


def count_vowels(text):
    """The number of vowels (a, e, i, o, u, either case) in `text`."""
    total = 0
    for c in text.lower():
        if c in "aeiou":
            total += 1
    return total


def slugify(text):
    """`text` lower-cased, its words joined by '-': 'Hello Big World' -> 'hello-big-world'."""
    words = text.lower().split()
    slug = "-".join(words)
    return slug


def longest_word(text):
    """The first of the longest words of `text` ('' when it has none)."""
    best = ""
    for word in text.split():
        if len(word) > len(best):
            best = word
    return best


def initials(text):
    """The upper-cased first letters of the words of `text`: 'ada lovelace' -> 'AL'."""
    letters = [word[0] for word in text.split()]
    joined = "".join(letters)
    return joined.upper()


def unique_words(text):
    """The words of `text` without repeats, in the order they first appear."""
    seen, out = set(), []
    for word in text.split():
        if word not in seen:
            seen.add(word)
            out.append(word)
    return out


def strip_punctuation(text):
    """`text` without the characters of string.punctuation."""
    import string

    kept = [c for c in text if c not in string.punctuation]
    return "".join(kept)
