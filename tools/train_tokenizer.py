"""Train the tiny recipe's byte-level BPE tokenizer on this Python's standard library sources.

    python tools/train_tokenizer.py [--out configs/tokenizers/tiny-bpe] [--vocab-size 4096]
                                    [--stdlib PATH] [--max-files N]

Rerun it with the defaults to regenerate configs/tokenizers/tiny-bpe (its README records the command and
the Python whose stdlib trained the shipped files; another Python's stdlib gives a different tokenizer).

Ids: 0-4 are the special tokens, in this order: `<|endoftext|>` (EOS), `<|im_start|>`, `<|im_end|>`,
`<tool_call>`, `</tool_call>`; 5-260 the 256 bytes (GPT-2's byte-to-unicode alphabet, by code point);
then the merges, up to `--vocab-size` ids in all. Each special token is one id, also inside text.

Corpus: every `*.py` file under the stdlib except those in `site-packages`, `test`, `tests`, `idlelib`,
`encodings` and `pydoc_data`, and `_sysconfigdata_*` (see CORPUS_EXCLUDE). Held out (never trained on)
are the files the tiny pretraining recipe evaluates on (`split_indices` with eval_fraction 0.05); the
script prints bytes per token measured on them. Output: DIR/tokenizer.json and DIR/tokenizer_config.json,
which transformers' AutoTokenizer loads as a fast tokenizer (no chat template: export writes its own).
The same files give a byte-identical tokenizer.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from composer_jax.data.errors import DataError
from composer_jax.data.sources import list_files, split_indices  # imports no jax

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
EOS_TOKEN = SPECIAL_TOKENS[0]
# Tests, IDLE, the generated codec tables of `encodings` (~30% of the remaining bytes) and pydoc's
# topic prose are not the code the model writes; `_sysconfigdata_*` holds this build's paths and flags,
# which would make the tokenizer depend on the machine that built Python.
CORPUS_EXCLUDE = ("site-packages", "test", "tests", "idlelib", "encodings", "pydoc_data")
# The held-out share of `configs/pretrain-tiny.yaml` (data.eval_fraction): keyed by relative path, so the
# tokenizer never sees the files whose loss that recipe reports.
HELD_OUT_FRACTION = 0.05
# The longest position range of the tiny recipe's configs (rl-coding-tiny: 4096 RoPE positions).
MODEL_MAX_LENGTH = 4096


def corpus_files(root: Path, max_files: int | None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) under `root`, each sorted by relative path."""
    root, names = list_files(str(root), "**/*.py", CORPUS_EXCLUDE)
    names = [n for n in names if not Path(n).name.startswith("_sysconfigdata_")]
    held = set(split_indices(names, "eval", HELD_OUT_FRACTION).tolist())
    train = [root / n for i, n in enumerate(names) if i not in held]
    if max_files is not None and len(train) > max_files:
        train = train[::-(-len(train) // max_files)]   # evenly spaced, so a sample spans the whole tree
    return train, [root / names[i] for i in sorted(held)]


def read_texts(files: list[Path]) -> tuple[list[str], list[Path]]:
    """The UTF-8 texts of `files`, and the files skipped as not UTF-8."""
    texts, skipped = [], []
    for path in files:
        try:
            texts.append(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            skipped.append(path)
    return texts, skipped


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with SPECIAL_TOKENS at ids 0..4; no normalizer, so decoding is exact."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)   # also registers SPECIAL_TOKENS as special added tokens
    return tokenizer


def tokenizer_config() -> dict:
    """tokenizer_config.json for transformers' AutoTokenizer (a PreTrainedTokenizerFast, no chat template)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,   # would alter decoded code (" ." -> ".")
    }


def bytes_per_token(tokenizer: Tokenizer, texts: list[str]) -> float:
    """UTF-8 bytes per token over `texts` together (1.0 would be a byte-level tokenizer)."""
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    return sum(len(t.encode()) for t in texts) / max(1, sum(len(e.ids) for e in encoded))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "configs/tokenizers/tiny-bpe",
                        help="output directory (default: the repository's configs/tokenizers/tiny-bpe)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="ids in all, special tokens included")
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                        help="the source tree to train on (default: this Python's standard library)")
    parser.add_argument("--max-files", type=int, help="train on at most this many files (evenly spaced)")
    args = parser.parse_args()
    floor = len(SPECIAL_TOKENS) + 256
    if args.vocab_size <= floor:
        parser.error(f"--vocab-size {args.vocab_size} leaves no merges: it must exceed {floor} "
                     "(special tokens + 256 bytes)")
    if args.max_files is not None and args.max_files < 1:
        parser.error(f"--max-files {args.max_files}: must be at least 1")
    try:
        train_files, held_files = corpus_files(args.stdlib, args.max_files)
    except DataError as e:
        parser.error(f"--stdlib: {e}")
    texts, skipped = read_texts(train_files)
    if not texts:
        parser.error(f"--stdlib {args.stdlib}: no UTF-8 training files left after holding out {len(held_files)}")
    start = time.perf_counter()
    tokenizer = train_tokenizer(texts, args.vocab_size)
    seconds = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out / "tokenizer.json"), pretty=True)
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")

    corpus_mb = sum(len(t.encode()) for t in texts) / 1e6
    print(f"trained on {len(texts)} files ({corpus_mb:.1f} MB) of {args.stdlib} in {seconds:.1f} s"
          + (f"; skipped {len(skipped)} not UTF-8: {', '.join(map(str, skipped))}" if skipped else ""))
    size_kb = (args.out / "tokenizer.json").stat().st_size / 1e3
    print(f"wrote {args.out}/tokenizer.json ({tokenizer.get_vocab_size()} ids, {size_kb:.0f} KB) "
          "and tokenizer_config.json")
    held_texts, _ = read_texts(held_files)
    if held_texts:
        print(f"held out {len(held_texts)} files: {bytes_per_token(tokenizer, held_texts):.2f} bytes/token "
              f"(training files: {bytes_per_token(tokenizer, texts):.2f})")
    else:
        print("held out no files: bytes/token not measured")


if __name__ == "__main__":
    main()
