from textkit import capitalize_words, char_histogram, is_palindrome, truncate, word_count


def test_word_count():
    assert word_count("a b  c") == 3
    assert word_count("") == 0


def test_capitalize_words():
    assert capitalize_words("hello big world") == "Hello Big World"


def test_is_palindrome():
    assert is_palindrome("Never odd or even")
    assert not is_palindrome("abc")


def test_char_histogram():
    assert char_histogram("aab a") == {"a": 3, "b": 1}


def test_truncate():
    assert truncate("short", 10) == "short"
    assert truncate("a long sentence", 8) == "a lon..."
