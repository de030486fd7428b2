"""Data: tokenizers, sources, the held-out split, packing, resumable iteration, SFT masks, bad inputs."""

import base64
import json

import numpy as np
import pytest
import tiktoken
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from composer_jax.config import ConfigError
from composer_jax.data import chat, code_conversations
from composer_jax.data.config import DataConfig
from composer_jax.data.errors import DataError
from composer_jax.data.pipeline import build_dataset
from composer_jax.data.sources import SkipLog, TextTreeSource, list_files, read_text_file, split_indices
from composer_jax.data.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer
from composer_jax.train.config import load_run_config

BYTE = ByteTokenizer()


def _tree(tmp_path, n=30):
    """A code tree of `n` small documents plus a binary file, an empty file and a non-matching file."""
    root = tmp_path / "tree"
    (root / "pkg").mkdir(parents=True)
    for i in range(n):
        (root / "pkg" / f"m{i:02d}.py").write_text(f"# doc {i}\n" + "x = 1\n" * (i % 7 + 1))
    (root / "blob.py").write_bytes(b"\x00\x01\x02binary")
    (root / "empty.py").write_text("   \n")
    (root / "notes.txt").write_text("not python")
    return root


def _docs(ds, batches=None):
    """Documents (as text) of the first `batches` batches (None: all), from tokens and segment ids."""
    out = []
    for n, b in enumerate(ds):
        if n == batches:
            break
        for toks, segs in zip(b["tokens"], b["segment_ids"]):
            for s in np.unique(segs[segs > 0]):
                out.append(BYTE.decode(toks[segs == s]))
    return out


# -- tokenizers ------------------------------------------------------------------------------------


def test_byte_tokenizer_roundtrip():
    text = "def f(x):\n    return 'é' * x\n"
    ids = BYTE.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 256 and BYTE.decode(ids) == text


def test_hf_tokenizer_json(tmp_path):
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def foo(x):\n    return x + 1\n"] * 20, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    loaded = load_tokenizer(str(path))
    ids = loaded.encode("def foo(y): return y")
    assert list(ids) == tok.encode("def foo(y): return y", add_special_tokens=False).ids
    assert loaded.decode(ids) == "def foo(y): return y"
    assert loaded.eos_id == tok.token_to_id("<|endoftext|>") and loaded.vocab_size == tok.get_vocab_size()
    assert load_tokenizer(str(tmp_path)).vocab_size == loaded.vocab_size  # a directory holding tokenizer.json


def test_tiktoken_file(tmp_path):
    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({b"de": 256, b"def": 257, b"  ": 258})
    path = tmp_path / "code.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    tok = load_tokenizer(str(path))
    text = "def  f(): pass"
    ids = tok.encode(text)
    reference = tiktoken.Encoding("ref", pat_str=r"\s+|\S+", mergeable_ranks=ranks, special_tokens={})
    assert 257 in ids and tok.decode(ids) == text
    assert reference.decode(list(ids)) == text
    assert tok.eos_id == 259 and tok.vocab_size == 260


@pytest.mark.parametrize("content, message", [
    (b"{not json", "is not valid JSON"),
    (b'{"version": "1.0", "model": {"type": "Nope"}}', "does not load as a Hugging Face tokenizer.json"),
])
def test_bad_tokenizer_json(tmp_path, content, message):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    with pytest.raises(TokenizerError, match=message) as e:
        load_tokenizer(str(path))
    assert str(path) in str(e.value)


def test_bad_tiktoken_file_and_missing_file(tmp_path):
    path = tmp_path / "vocab.bpe"
    path.write_text("this is not base64 rank\n")
    with pytest.raises(TokenizerError, match=r"vocab.bpe is neither .* line 1"):
        load_tokenizer(str(path))
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))


# -- sources and bad paths ---------------------------------------------------------------------------


def test_text_tree_skips_binary_and_empty_files_counted(tmp_path):
    root = _tree(tmp_path)
    skips = SkipLog()
    src = TextTreeSource(str(root), "**/*.py", (), 1_000_000, skips)
    records = [src[i] for i in range(len(src))]
    assert len(src) == 32 and sum(r is not None for r in records) == 30
    assert skips.counts == {"binary": 1, "empty": 1}
    assert read_text_file(root / "pkg", 10**6, skips) is None and skips.counts["unreadable"] == 1  # a directory
    assert read_text_file(root / "pkg" / "m06.py", 10, skips) is None and skips.counts["too_large"] == 1


def test_bad_data_paths_name_the_path(tmp_path):
    with pytest.raises(DataError, match=f"{tmp_path / 'nope'} does not exist"):
        list_files(str(tmp_path / "nope"), "**/*")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="is an empty directory"):
        list_files(str(tmp_path / "empty"), "**/*")
    root = _tree(tmp_path)
    with pytest.raises(DataError, match=r"has no files matching '\*\*/\*.rs'"):
        list_files(str(root), "**/*.rs")
    only_binary = tmp_path / "bin"
    only_binary.mkdir()
    (only_binary / "a.py").write_bytes(b"\x00" * 10)
    with pytest.raises(DataError, match=rf"{only_binary}: none of the first 1 train records is usable \(binary x1\)"):
        build_dataset(DataConfig(path=str(only_binary), eval_fraction=0.0), BYTE, split="train", seq_len=16,
                      batch_size=2, repeat=True)


def test_sequence_length_beyond_the_model_is_a_config_error():
    with pytest.raises(ConfigError, match=r"'train.seq_len': 512 is longer than the model supports "
                                          r"\(model.rope.max_position_embeddings=128\)"):
        load_run_config("pretrain-tiny", ["train.seq_len=512"])


def test_jsonl_parquet_arrayrecord_sources(tmp_path):
    texts = [f"document number {i} " * (i % 4 + 1) for i in range(12)]
    jsonl = tmp_path / "data.jsonl"
    lines = [json.dumps({"text": t}) for t in texts] + ["{broken", json.dumps({"other": 1})]
    jsonl.write_text("\n".join(lines))  # no trailing newline on the last line
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": texts}), tmp_path / "data.parquet", row_group_size=5)
    from array_record.python.array_record_module import ArrayRecordWriter
    writer = ArrayRecordWriter(str(tmp_path / "data.array_record"), "group_size:1")
    for t in texts:
        writer.write(t.encode())
    writer.close()
    for kind, name in [("jsonl", "data.jsonl"), ("parquet", "data.parquet"), ("array_record", "data.array_record")]:
        skips = SkipLog()
        cfg = DataConfig(kind=kind, path=str(tmp_path / name), eval_fraction=0.0, shuffle=False)
        docs = _docs(build_dataset(cfg, BYTE, split="train", seq_len=2048, batch_size=1, repeat=False, skips=skips))
        assert docs == texts, kind  # every document, in order, one segment each
        if kind == "jsonl":
            assert skips.counts == {"bad_json": 1, "missing_field_text": 1}


# -- split, sharding, packing, resumption ----------------------------------------------------------------


def test_heldout_split_is_disjoint_stable_and_sized():
    keys = [f"pkg/mod_{i}.py" for i in range(2000)]
    train, held = split_indices(keys, "train", 0.1), split_indices(keys, "eval", 0.1)
    assert not set(train) & set(held) and len(train) + len(held) == 2000
    assert 150 < len(held) < 250
    np.testing.assert_array_equal(held, split_indices(list(keys), "eval", 0.1))
    ints = split_indices(range(10_000), "eval", 0.05)
    assert 400 < len(ints) < 600


def test_packing_segments_positions_and_process_shards(tmp_path):
    root = _tree(tmp_path)
    cfg = DataConfig(path=str(root), glob="**/*.py", eval_fraction=0.0, shuffle=False)
    ds = build_dataset(cfg, BYTE, split="train", seq_len=64, batch_size=4, repeat=False)
    originals = {(root / p).read_text() for p in TextTreeSource(str(root), "**/*.py", (), 10**6, SkipLog()).files}
    originals -= {"\x00\x01\x02binary", "   \n"}  # skipped: binary, empty
    rows = 0
    for batch in ds:
        assert {k: v.shape for k, v in batch.items()} == {k: (4, 64) for k in batch}
        for toks, segs, pos, mask in zip(batch["tokens"], batch["segment_ids"], batch["positions"],
                                         batch["loss_mask"]):
            rows += 1
            assert segs[0] == 1 and np.all(np.diff(segs[segs > 0]) >= 0)
            for s in np.unique(segs[segs > 0]):
                idx = np.flatnonzero(segs == s)
                np.testing.assert_array_equal(pos[idx], np.arange(len(idx)))  # positions restart per document
                piece = BYTE.decode(toks[idx])
                assert any(piece in doc for doc in originals)  # a document or a piece of one, never a mix
            np.testing.assert_array_equal(mask, segs > 0)
    assert rows >= 4
    # Two processes read disjoint halves that together cover every document.
    shards = [_docs(build_dataset(cfg, BYTE, split="train", seq_len=4096, batch_size=1, repeat=False,
                                  shard_index=i, shard_count=2)) for i in range(2)]
    assert not set(shards[0]) & set(shards[1]) and set(shards[0]) | set(shards[1]) == originals


def test_iteration_resumes_exactly_from_saved_state(tmp_path):
    root = _tree(tmp_path)
    cfg = DataConfig(path=str(root), glob="**/*.py", eval_fraction=0.0, seed=3)
    make = lambda: build_dataset(cfg, BYTE, split="train", seq_len=48, batch_size=2, repeat=True)  # noqa: E731
    it = iter(make())
    for _ in range(7):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # the checkpoint stores it as JSON
    expected = [next(it) for _ in range(25)]  # crosses an epoch boundary (reshuffled)
    resumed = iter(make())
    resumed.set_state(state)
    for a, b in zip(expected, (next(resumed) for _ in range(25))):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    # Every possible resume point of a short run, including ones between two documents.
    it = iter(make())
    stream = [(json.loads(json.dumps(it.get_state())), next(it)) for _ in range(12)]
    for k, (state, _) in enumerate(stream):
        resumed = iter(make())
        resumed.set_state(state)
        for _, batch in stream[k:k + 3]:
            np.testing.assert_array_equal(next(resumed)["tokens"], batch["tokens"])


# -- SFT conversations --------------------------------------------------------------------------------


CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."},
                {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4 and 4?"},
                {"role": "assistant", "content": "8"}]


def test_chat_loss_mask_covers_assistant_tokens_only():
    tokens, mask = chat.tokenize_conversation(CONVERSATION, BYTE.encode)
    text = BYTE.decode(tokens)
    assert text == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATION)
    trained = BYTE.decode(tokens[mask == 1])
    assert trained == "5<|im_end|>8<|im_end|>"     # the turns and their end markers, not the template around
    with pytest.raises(chat.ConversationError, match="no assistant message"):
        chat.tokenize_conversation(CONVERSATION[:2], BYTE.encode)


def test_sft_jsonl_pipeline_packs_whole_conversations(tmp_path):
    path = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "robot", "content": "x"}]}] + [{"messages": CONVERSATION}] * 5
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    skips = SkipLog()
    cfg = DataConfig(kind="jsonl", path=str(path), format="chat", eval_fraction=0.0, shuffle=False)
    batch = next(iter(build_dataset(cfg, BYTE, split="train", seq_len=256, batch_size=2, repeat=True, skips=skips)))
    assert skips.counts["bad_conversation"] >= 1
    tokens, mask = chat.tokenize_conversation(CONVERSATION, BYTE.encode)
    for toks, segs, m in zip(batch["tokens"], batch["segment_ids"], batch["loss_mask"]):
        for s in np.unique(segs[segs > 0]):  # each segment is one whole conversation with its mask
            np.testing.assert_array_equal(toks[segs == s], tokens)
            np.testing.assert_array_equal(m[segs == s], mask)


def test_python_function_conversations():
    source = ('import os\n\ndef add(a, b=1):\n    """Add two numbers."""\n    return a + b\n\n'
              'def bare(x):\n    return x\n')
    messages = code_conversations.python_function_conversations(source, "calc.py")
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert "def add(a, b=1)" in messages[1]["content"] and "Add two numbers." in messages[1]["content"]
    assert messages[2]["content"].startswith("def add(a, b=1):") and messages[2]["content"].endswith("return a + b")
    assert code_conversations.python_function_conversations("x = (", "broken.py") is None


def test_token_bytes_sum_to_the_texts_utf8_length(tmp_path):
    """`token_bytes()` of each tokenizer kind (what bits per byte divide by): over the ids of a text, they sum
    to the text's UTF-8 length (the independent reference); special tokens stand for no bytes."""
    from composer_jax.config import CONFIG_DIR
    from tests.test_chat import _kimi_tiktoken

    text = 'def f(x):\n    """Héllo, wörld 🎉"""\n    return x  # done\r\n\t'
    hf, kimi = load_tokenizer(str(CONFIG_DIR / "tokenizers" / "tiny-bpe")), load_tokenizer(str(_kimi_tiktoken(tmp_path)))
    for tok in (ByteTokenizer(), hf, kimi):
        sizes = tok.token_bytes()
        assert sizes.shape == (tok.vocab_size,) and sizes.dtype == np.int32, tok.name
        ids = tok.encode(text)
        assert int(sizes[ids].sum()) == len(text.encode("utf-8")), tok.name
    assert hf.token_bytes()[hf.eos_id] == 0 and kimi.token_bytes()[kimi.eos_id] == 0
    assert (kimi.token_bytes()[260:] == 0).all() and (kimi.token_bytes()[:256] == 1).all()
