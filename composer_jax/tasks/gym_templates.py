"""The coding gym's function templates: small, self-contained Python functions with their parameters.

A template is the source of one function with `{fn}` (its name, one of `names`) and parameters in braces,
drawn per repository by `params(rng)`; `args` names the kinds of its arguments, from which the gym draws
the test inputs (ARG_KINDS). The expected outputs are computed by running the rendered source itself, so
a template only has to be valid Python that returns plain values (ints, strings, bools, lists, tuples,
dicts): no floats whose digits could differ, no sets whose order could.

Loops are bounded `for` loops, never `while`: a mutated loop condition (bug injection) then cannot hang
the tests until their time limit. `held_out` templates never appear in a training repository: the
held-out split measures code the model has never seen, not only other names or constants.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

WORDS = ("apple", "river", "stone", "cloud", "tiger", "maple", "ember", "delta", "pixel", "orbit", "lemon",
         "quartz", "noble", "civic", "level", "radar", "zebra", "ivory", "olive", "amber")


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 5)))


ARG_KINDS: dict[str, Callable[[random.Random], object]] = {
    "int": lambda r: r.randint(-20, 20),
    "nat": lambda r: r.randint(0, 12),
    "ints": lambda r: [r.randint(-9, 9) for _ in range(r.randint(0, 7))],
    "nats": lambda r: [r.randint(0, 9) for _ in range(r.randint(0, 7))],
    "word": lambda r: r.choice(WORDS),
    "text": _text,
    "words": lambda r: [r.choice(WORDS) for _ in range(r.randint(0, 5))],
}


@dataclasses.dataclass(frozen=True)
class Template:
    key: str                                   # unique id of the template
    names: tuple[str, ...]                     # names the function may take
    args: tuple[str, ...]                      # ARG_KINDS of its arguments
    source: str                                # `def {fn}(...)` with {parameters}; docstring first
    params: Callable[[random.Random], dict] = lambda rng: {}
    held_out: bool = False

    def render(self, name: str, rng: random.Random) -> str:
        return self.source.format(fn=name, **self.params(rng)).strip() + "\n"


def _t(key, names, args, source, params=lambda rng: {}, held_out=False) -> Template:
    return Template(key, tuple(names.split()), tuple(args.split()), source, params, held_out)


TEMPLATES = (
    _t("clamp", "clamp bound limit", "int", '''
def {fn}(x):
    """`x` limited to the range [{lo}, {hi}]."""
    if x < {lo}:
        return {lo}
    if x > {hi}:
        return {hi}
    return x
''', lambda r: {"lo": r.randint(-9, 0), "hi": r.randint(1, 9)}),
    _t("sign", "sign signum", "int", '''
def {fn}(x):
    """-1, 0 or 1: the sign of `x`."""
    if x > 0:
        return 1
    if x < 0:
        return -1
    return 0
'''),
    _t("sum_positive", "sum_positive positive_total", "ints", '''
def {fn}(values):
    """The sum of the values of `values` greater than {k}."""
    total = 0
    for v in values:
        if v > {k}:
            total += v
    return total
''', lambda r: {"k": r.randint(-2, 3)}),
    _t("count_multiples", "count_multiples multiples_of", "ints", '''
def {fn}(values):
    """How many values of `values` are multiples of {k}."""
    count = 0
    for v in values:
        if v % {k} == 0:
            count += 1
    return count
''', lambda r: {"k": r.randint(2, 5)}),
    _t("running_sum", "running_sum prefix_sums cumulative", "ints", '''
def {fn}(values):
    """The running totals of `values`: [a, a + b, a + b + c, ...]."""
    out = []
    total = 0
    for v in values:
        total += v
        out.append(total)
    return out
'''),
    _t("pairwise_diff", "pairwise_diff differences steps", "ints", '''
def {fn}(values):
    """The differences of neighbours: [b - a, c - b, ...] (empty for fewer than two values)."""
    out = []
    for i in range(1, len(values)):
        out.append(values[i] - values[i - 1])
    return out
'''),
    _t("max_index", "argmax index_of_max", "ints", '''
def {fn}(values):
    """The index of the first largest value of `values`, or -1 when it is empty."""
    if not values:
        return -1
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best
'''),
    _t("scale_list", "scale_all times_each", "ints", '''
def {fn}(values):
    """Each value of `values` multiplied by {k} and then increased by {b}."""
    result = []
    for v in values:
        result.append(v * {k} + {b})
    return result
''', lambda r: {"k": r.randint(2, 4), "b": r.randint(-3, 3)}),
    _t("dedupe", "dedupe unique_in_order", "nats", '''
def {fn}(values):
    """`values` without repeats, in the order of first appearance."""
    seen = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen
'''),
    _t("chunk", "chunks split_every", "ints", '''
def {fn}(values):
    """`values` cut into lists of {k} (the last may be shorter)."""
    out = []
    for start in range(0, len(values), {k}):
        out.append(values[start:start + {k}])
    return out
''', lambda r: {"k": r.randint(2, 3)}),
    _t("count_words", "count_words word_total", "text", '''
def {fn}(text):
    """The number of words of `text` with more than {k} letters."""
    words = text.split()
    long_words = [w for w in words if len(w) > {k}]
    return len(long_words)
''', lambda r: {"k": r.randint(3, 5)}),
    _t("acronym", "acronym initials_of", "text", '''
def {fn}(text):
    """The first letters of the words of `text`, upper-cased and joined with {sep!r}."""
    letters = [w[0].upper() for w in text.split()]
    joined = {sep!r}.join(letters)
    return joined
''', lambda r: {"sep": r.choice(["", ".", "-"])}),
    _t("title_case", "title_case capitalize_each", "text", '''
def {fn}(text):
    """Each word of `text` with its first letter upper-case, joined by single spaces."""
    words = text.split()
    titled = [w[:1].upper() + w[1:] for w in words]
    return " ".join(titled)
'''),
    _t("reverse_words", "reverse_words backwards_words", "text", '''
def {fn}(text):
    """The words of `text` in reverse order, joined by {sep!r}."""
    words = text.split()
    words.reverse()
    return {sep!r}.join(words)
''', lambda r: {"sep": r.choice([" ", ",", "/"])}),
    _t("vowel_count", "count_vowels vowels_in", "text", '''
def {fn}(text):
    """How many characters of `text` are vowels (a, e, i, o, u)."""
    count = 0
    for c in text:
        if c in "aeiou":
            count += 1
    return count
'''),
    _t("longest_word", "longest_word longest", "text", '''
def {fn}(text):
    """The first longest word of `text`, or "" when it has none."""
    best = ""
    for word in text.split():
        if len(word) > len(best):
            best = word
    return best
'''),
    _t("char_counts", "char_counts letter_histogram", "word", '''
def {fn}(word):
    """{{letter: count}} of the letters of `word`, in order of first appearance."""
    counts = {{}}
    for c in word:
        counts[c] = counts.get(c, 0) + 1
    return counts
'''),
    _t("is_palindrome", "is_palindrome reads_same_backwards", "word", '''
def {fn}(word):
    """Whether `word` reads the same backwards."""
    letters = list(word)
    backwards = letters[::-1]
    return letters == backwards
'''),
    _t("pad_left", "pad_left left_pad", "word nat", '''
def {fn}(word, width):
    """`word` padded on the left with {c!r} to at least `width` characters."""
    missing = width - len(word)
    if missing <= 0:
        return word
    return {c!r} * missing + word
''', lambda r: {"c": r.choice(["*", ".", "0"])}),
    _t("repeat_word", "repeat_word echo", "word nat", '''
def {fn}(word, times):
    """`word` repeated `times` times, separated by {sep!r} (empty for 0 times)."""
    parts = []
    for _ in range(times):
        parts.append(word)
    return {sep!r}.join(parts)
''', lambda r: {"sep": r.choice(["-", " ", ""])}),
    _t("digit_sum", "digit_sum sum_of_digits", "nat", '''
def {fn}(n):
    """The sum of the decimal digits of `n` (n >= 0), times {k}."""
    total = 0
    for d in str(n):
        total += int(d)
    return total * {k}
''', lambda r: {"k": r.randint(1, 3)}),
    _t("factorial", "factorial product_up_to", "nat", '''
def {fn}(n):
    """1 * 2 * ... * n for n >= 1, and 1 for n == 0."""
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
'''),
    _t("fizz", "fizz fizzbuzz_word", "nat", '''
def {fn}(n):
    """"{a}{b}" if `n` is a multiple of {p} and {q}, "{a}" of {p} only, "{b}" of {q} only, else str(n)."""
    if n % {p} == 0 and n % {q} == 0:
        return "{a}{b}"
    if n % {p} == 0:
        return "{a}"
    if n % {q} == 0:
        return "{b}"
    return str(n)
''', lambda r: {"p": r.choice([2, 3]), "q": r.choice([5, 7]), "a": r.choice(["Fizz", "Foo"]),
               "b": r.choice(["Buzz", "Bar"])}),
    _t("collatz_steps", "collatz_steps steps_to_one", "nat", '''
def {fn}(n):
    """How many Collatz steps (n / 2 if even, 3n + 1 if odd) take `n` to 1 (0 for n <= 1), at most 200."""
    steps = 0
    for _ in range(200):
        if n <= 1:
            break
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps
'''),
    _t("triangle", "triangle_number triangular", "nat", '''
def {fn}(n):
    """{k} times the sum 1 + 2 + ... + n."""
    total = 0
    for i in range(1, n + 1):
        total += i
    return {k} * total
''', lambda r: {"k": r.randint(1, 3)}),
    _t("between", "count_between in_range_count", "ints", '''
def {fn}(values):
    """How many values of `values` lie in [{lo}, {hi}]."""
    inside = 0
    for v in values:
        if {lo} <= v <= {hi}:
            inside += 1
    return inside
''', lambda r: {"lo": r.randint(-6, 0), "hi": r.randint(1, 6)}),
    _t("evens_odds", "split_parity evens_and_odds", "ints", '''
def {fn}(values):
    """(the even values, the odd values) of `values`, each in order."""
    evens = [v for v in values if v % 2 == 0]
    odds = [v for v in values if v % 2 != 0]
    return (evens, odds)
'''),
    _t("rotate", "rotate_left shift_left", "ints", '''
def {fn}(values):
    """`values` rotated left by {k} places (empty stays empty)."""
    if not values:
        return []
    k = {k} % len(values)
    return values[k:] + values[:k]
''', lambda r: {"k": r.randint(1, 3)}),
    _t("second_largest", "second_largest runner_up", "ints", '''
def {fn}(values):
    """The second largest distinct value of `values`, or None when there is none."""
    distinct = sorted(set(values))
    if len(distinct) < 2:
        return None
    return distinct[-2]
'''),
    _t("word_lengths", "word_lengths lengths_of_words", "words", '''
def {fn}(words):
    """{{word: len(word)}} for the words of `words` longer than {k} letters."""
    lengths = {{}}
    for w in words:
        if len(w) > {k}:
            lengths[w] = len(w)
    return lengths
''', lambda r: {"k": r.randint(3, 5)}),
    _t("join_nonempty", "join_words glue", "words", '''
def {fn}(words):
    """The words of `words` that do not start with {c!r}, joined by {sep!r}."""
    kept = []
    for w in words:
        if not w.startswith({c!r}):
            kept.append(w)
    return {sep!r}.join(kept)
''', lambda r: {"c": r.choice("aeiorcl"), "sep": r.choice([" ", "+", ", "])}),
    _t("first_letters", "group_by_first index_by_letter", "words", '''
def {fn}(words):
    """{{first letter: [words starting with it, in order]}} for the words of `words`."""
    groups = {{}}
    for w in words:
        groups.setdefault(w[0], []).append(w)
    return groups
'''),
    _t("caesar", "caesar shift_letters", "word", '''
def {fn}(word):
    """`word` (lower-case letters) with every letter moved {k} places on in the alphabet, wrapping."""
    out = []
    for c in word:
        out.append(chr((ord(c) - ord("a") + {k}) % 26 + ord("a")))
    return "".join(out)
''', lambda r: {"k": r.randint(1, 25)}),
    _t("alternate_case", "alternate_case zigzag_case", "word", '''
def {fn}(word):
    """`word` with the letters at even positions upper-case and the others lower-case."""
    out = []
    for i, c in enumerate(word):
        out.append(c.upper() if i % 2 == 0 else c.lower())
    return "".join(out)
'''),
    _t("gcd", "gcd greatest_common_divisor", "nat nat", '''
def {fn}(a, b):
    """The greatest common divisor of `a` and `b` (a, b >= 0, at most 12; gcd(0, 0) is 0)."""
    for _ in range(20):
        if b == 0:
            break
        a, b = b, a % b
    return a
'''),
    _t("power_sum", "power_sum sum_of_powers", "nats", '''
def {fn}(values):
    """The sum of each value of `values` raised to the power {k}."""
    total = 0
    for v in values:
        total += v ** {k}
    return total
''', lambda r: {"k": r.randint(2, 3)}),
    # held out: never in a training repository
    _t("run_lengths", "run_lengths encode_runs", "nats", '''
def {fn}(values):
    """[(value, how many times it repeats in a row), ...] of `values`."""
    runs = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1] = (v, runs[-1][1] + 1)
        else:
            runs.append((v, 1))
    return runs
''', held_out=True),
    _t("count_above_mean", "above_average count_above_mean", "ints", '''
def {fn}(values):
    """How many values of `values` are greater than their mean (0 for an empty list)."""
    if not values:
        return 0
    total = sum(values)
    return len([v for v in values if v * len(values) > total])
''', held_out=True),
    _t("interleave", "interleave weave", "ints ints", '''
def {fn}(first, second):
    """The values of `first` and `second` taken in turn; the rest of the longer one at the end."""
    out = []
    for i in range(max(len(first), len(second))):
        if i < len(first):
            out.append(first[i])
        if i < len(second):
            out.append(second[i])
    return out
''', held_out=True),
    _t("vowel_positions", "vowel_positions where_vowels", "word", '''
def {fn}(word):
    """The indices of the vowels (a, e, i, o, u) of `word`, each plus {k}."""
    positions = []
    for i, c in enumerate(word):
        if c in "aeiou":
            positions.append(i + {k})
    return positions
''', lambda r: {"k": r.randint(0, 2)}, held_out=True),
    _t("longest_run", "longest_run longest_streak", "nats", '''
def {fn}(values):
    """The length of the longest run of equal neighbours in `values` (0 when empty)."""
    best = 0
    current = 0
    for i, v in enumerate(values):
        current = current + 1 if i and values[i - 1] == v else 1
        best = max(best, current)
    return best
''', held_out=True),
    _t("mirror_words", "mirror_words reverse_each", "text", '''
def {fn}(text):
    """Each word of `text` spelled backwards, the words in their order, joined by {sep!r}."""
    words = text.split()
    mirrored = [w[::-1] for w in words]
    return {sep!r}.join(mirrored)
''', lambda r: {"sep": r.choice([" ", "_"])}, held_out=True),
    _t("min_max", "min_and_max extremes", "ints", '''
def {fn}(values):
    """(smallest, largest) of `values`, or ({d}, {d}) when it is empty."""
    if not values:
        return ({d}, {d})
    low = high = values[0]
    for v in values[1:]:
        low, high = min(low, v), max(high, v)
    return (low, high)
''', lambda r: {"d": r.choice([0, -1])}, held_out=True),
    _t("count_digits", "count_digits digits_in", "int", '''
def {fn}(n):
    """How many decimal digits `n` has, ignoring its sign, plus {k}."""
    n = abs(n)
    digits = 1
    for _ in range(20):
        if n < 10:
            break
        n //= 10
        digits += 1
    return digits + {k}
''', lambda r: {"k": r.randint(0, 2)}, held_out=True),
    _t("squash_spaces", "squash_spaces normalize_spaces", "text", '''
def {fn}(text):
    """`text` upper-cased with the words joined by {sep!r}, no leading or trailing separator."""
    words = text.split()
    upper = [w.upper() for w in words]
    return {sep!r}.join(upper)
''', lambda r: {"sep": r.choice(["-", ":"])}, held_out=True),
    _t("windows", "window_sums sliding_sums", "ints", '''
def {fn}(values):
    """The sums of every {k} neighbouring values of `values` (empty when it has fewer)."""
    sums = []
    for start in range(len(values) - {k} + 1):
        sums.append(sum(values[start:start + {k}]))
    return sums
''', lambda r: {"k": r.randint(2, 3)}, held_out=True),
)
