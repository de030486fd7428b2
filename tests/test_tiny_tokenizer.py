"""The shipped tiny-recipe BPE tokenizer (configs/tokenizers/tiny-bpe) and the script that trains it."""

import importlib.util
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "configs/tokenizers/tiny-bpe"
SCRIPT = REPO / "tools/train_tokenizer.py"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
UNICODE_TEXT = ("naïve café ß ﬁ Ω≈ç √ 日本語のテキスト 한국어 العربية 🙂👍🏽 e\u0301 \u200b\ttab\r\ncrlf\x00nul"
                "  trailing  \n\n\n    indented\U0001f600")

spec = importlib.util.spec_from_file_location("train_tokenizer", SCRIPT)
train_tokenizer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_tokenizer)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))


@pytest.fixture(scope="module")
def held_out_texts() -> list[str]:
    """The stdlib files the tokenizer was not trained on (the tiny pretraining recipe's eval split)."""
    _, held = train_tokenizer.corpus_files(STDLIB, None)
    texts, _ = train_tokenizer.read_texts(held)
    assert len(texts) >= 5, f"only {len(texts)} held-out files under {STDLIB}"
    return texts


def test_tokenizer_has_4096_ids_with_special_tokens_first(tokenizer):
    assert tokenizer.get_vocab_size() == 4096
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert sorted(tokenizer.get_vocab().values()) == list(range(4096))   # no gaps, no duplicates


@pytest.mark.parametrize("special", SPECIAL_TOKENS)
def test_special_token_is_one_id_inside_text(tokenizer, special):
    ids = tokenizer.encode(f"a{special}b", add_special_tokens=False).ids
    assert ids == [tokenizer.token_to_id("a"), SPECIAL_TOKENS.index(special), tokenizer.token_to_id("b")]


def test_transformers_loads_a_fast_tokenizer_without_chat_template():
    hf = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    assert isinstance(hf, PreTrainedTokenizerFast)
    assert (hf.eos_token, hf.eos_token_id) == ("<|endoftext|>", 0)
    assert sorted(hf.all_special_tokens) == sorted(SPECIAL_TOKENS)
    assert len(hf) == 4096 and hf.model_max_length == 4096
    assert hf.chat_template is None


def test_round_trips_stdlib_files_and_unicode_exactly(tokenizer, held_out_texts):
    # cp1252.py (a codec table, not trained on) is full of non-ASCII characters.
    texts = held_out_texts[:4] + [(STDLIB / "encodings/cp1252.py").read_text("utf-8"), UNICODE_TEXT,
                                  "a<|im_end|>b<tool_call>{}</tool_call>"]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_held_out_code_compresses_to_over_3_bytes_per_token(tokenizer, held_out_texts):
    # Measured 3.42 on CPython 3.11.7's held-out files (3.40 on 3.12.1, 3.36 on 3.13.0).
    assert train_tokenizer.bytes_per_token(tokenizer, held_out_texts) >= 3.2


def test_transformers_encodes_like_tokenizers(tokenizer, held_out_texts):
    hf = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    for text in [held_out_texts[0], UNICODE_TEXT, "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]:
        assert hf.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False).ids


def test_training_script_writes_a_loadable_deterministic_tokenizer(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "pkg").mkdir(parents=True)
    for i in range(6):
        (corpus / "pkg" / f"module_{i}.py").write_text("".join(
            f"def function_{i}_{j}(value, count={j}):\n    \"\"\"Return value times count.\"\"\"\n"
            f"    result = value * count  # é\n    return result\n\n" for j in range(20)))
    outputs = []
    for run in ("a", "b"):
        out = tmp_path / run
        subprocess.run([sys.executable, str(SCRIPT), "--stdlib", str(corpus), "--vocab-size", "300",
                        "--out", str(out)], check=True, capture_output=True, text=True, timeout=60)
        outputs.append((out / "tokenizer.json").read_bytes())
    assert outputs[0] == outputs[1]
    trained = Tokenizer.from_file(str(tmp_path / "a/tokenizer.json"))
    assert trained.get_vocab_size() == 300
    assert [trained.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert trained.encode("x<|im_end|>", add_special_tokens=False).ids[-1] == 2
    assert isinstance(AutoTokenizer.from_pretrained(tmp_path / "a"), PreTrainedTokenizerFast)
