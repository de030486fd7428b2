from textkit import (capitalize_words, char_histogram, count_vowels, initials, is_palindrome, longest_word,
                     reverse_words, slugify, strip_punctuation, truncate, unique_words, word_count)


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


def test_reverse_words():
    assert reverse_words("one two  three") == "three two one"
    assert reverse_words("") == ""


def test_count_vowels():
    assert count_vowels("Programming In Python") == 5
    assert count_vowels("xyz") == 0


def test_slugify():
    assert slugify("Hello Big  World") == "hello-big-world"


def test_longest_word():
    assert longest_word("a bb ccc dd eee") == "ccc"
    assert longest_word("   ") == ""


def test_initials():
    assert initials("ada lovelace") == "AL"
    assert initials("") == ""


def test_unique_words():
    assert unique_words("b a b c a") == ["b", "a", "c"]


def test_strip_punctuation():
    assert strip_punctuation("Hi, there! (ok?)") == "Hi there ok"
