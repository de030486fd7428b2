"""The one chat renderer (composer_jax.data.chat) against transformers' `apply_chat_template` running the
Jinja template an export writes: the same text and the same trained (assistant) tokens, in both formats,
for conversations with tool calls, tool results, hints and unicode; Kimi tokenizers' markers as single ids."""

import base64
import json

import numpy as np
import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from composer_jax.data import chat
from composer_jax.data.tokenizer import ByteTokenizer, byte_tokenizer_json, load_tokenizer
from composer_jax.envs import TOOLS, get_format, parse_turn

SCHEMAS = [t.schema() for t in TOOLS]
CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the bug in ünïcode.py: `x = «1»`"},
    {"role": "assistant", "content": "Looking first.", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "read_file", "arguments": {"path": "x.py", "start_line": 2}}},
        {"id": "b", "type": "function", "function": {"name": "list_dir", "arguments": '{"path": "src"}'}}]},
    {"role": "tool", "tool_call_id": "b", "content": "a.py\nb/"},
    {"role": "tool", "tool_call_id": "a", "content": "2: x = 1"},
    {"role": "assistant", "content": "", "weight": 0},
    {"role": "system", "content": "Reminder: call a tool."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "edit", "arguments": {"path": "x.py", "old": "1", "new": "2 ✓"}}}]},
    {"role": "tool", "tool_call_id": "c", "content": "edited x.py"},
    {"role": "assistant", "content": "Done.", "tool_calls": [{"id": "d", "function": {"name": "submit", "arguments": {}}}]},
]


@pytest.fixture(scope="module")
def byte_hf():
    """transformers' fast tokenizer over a tokenizer.json of the 256 bytes (ids = UTF-8 bytes)."""
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(byte_tokenizer_json()))


@pytest.mark.parametrize("name", ["plain", "kimi"])
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_renderer_equals_transformers_apply_chat_template(byte_hf, name, generation_prompt):
    fmt = chat.get_chat_format(name)
    byte_hf.chat_template = fmt.chat_template()
    ours = "".join(text for text, _ in chat.render(CONVERSATION, fmt, SCHEMAS, generation_prompt=generation_prompt))
    reference = byte_hf.apply_chat_template(CONVERSATION, tools=SCHEMAS, tokenize=False,
                                            add_generation_prompt=generation_prompt)
    assert ours == reference
    # The loss mask: transformers' assistant mask ({% generation %}) over the same bytes.
    tokens, mask = chat.tokenize_conversation(CONVERSATION, ByteTokenizer().encode, fmt, SCHEMAS)
    out = byte_hf.apply_chat_template(CONVERSATION, tools=SCHEMAS, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
    assert list(out["input_ids"]) == tokens.tolist() and list(out["assistant_masks"]) == mask.tolist()
    trained = ByteTokenizer().decode(tokens[mask == 1])
    assert trained.startswith("Looking first.") and trained.count(fmt.end_of_turn) == 3   # the weight-0 turn is not


@pytest.mark.parametrize("name", ["plain", "kimi"])
def test_rendered_calls_parse_back_and_tool_results_name_their_call(name):
    fmt = get_format(name)
    pieces = chat.render(CONVERSATION, fmt, SCHEMAS)
    text, turn = "".join(p for p, _ in pieces), next(p for p, trained in pieces if trained)
    parsed = parse_turn(turn.removesuffix(fmt.end_of_turn), fmt, TOOLS)
    assert parsed.text == "Looking first." and not parsed.errors
    assert [(c.name, c.arguments) for c in parsed.calls] == [("read_file", {"path": "x.py", "start_line": 2}),
                                                              ("list_dir", {"path": "src"})]
    if name == "kimi":   # ids count the conversation's calls; results name the call they answer
        assert "functions.edit:2<|tool_call_argument_begin|>" in text
        assert "## Return of functions.list_dir:1\na.py" in text and "## Return of functions.read_file:0\n2:" in text
    # a result without tool_call_id answers the next unanswered call, in order
    ordered = [m if m["role"] != "tool" else {k: v for k, v in m.items() if k != "tool_call_id"}
               for m in CONVERSATION]
    assert [m.name for m in chat.parse_messages(ordered) if m.role == "tool"] == ["a", "b", "c"]


@pytest.mark.parametrize("messages, error", [
    ([], "non-empty list"),
    ([{"role": "robot", "content": "x"}], "role 'robot'"),
    ([{"role": "user", "content": "x"}], "no assistant message to train on"),
    ([{"role": "assistant", "content": "x", "weight": 0}], "no assistant message to train on"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}], "tool call 0"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "run", "arguments": "{x"}}]}],
     "not valid JSON"),
])
def test_bad_conversations_are_one_line_errors(messages, error):
    with pytest.raises(chat.ConversationError, match=error):
        chat.tokenize_conversation(messages, ByteTokenizer().encode)


def _kimi_tiktoken(directory):
    """A tiktoken.model of 256 bytes and a few merges, with a Kimi-style tokenizer_config.json registering
    the chat and tool-call markers as special tokens (as Kimi K2's checkpoint does)."""
    ranks = [bytes([i]) for i in range(256)] + [b"he", b"ll", b"hell", b"hello"]
    (directory / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {i}\n"
                                                      for i, t in enumerate(ranks)))
    specials = ["[BOS]", "[EOS]", *chat.KimiChat.markers]
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(260 + i): {"content": t, "special": True} for i, t in enumerate(specials)},
        "eos_token": "[EOS]", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}))
    return directory / "tiktoken.model"


def test_kimi_tiktoken_markers_are_single_ids_and_pick_the_kimi_format(tmp_path):
    tok = load_tokenizer(str(_kimi_tiktoken(tmp_path)))
    assert tok.vocab_size == 260 + 2 + len(chat.KimiChat.markers) and tok.eos_id == 261
    for marker in chat.KimiChat.markers:
        assert len(tok.encode(marker)) == 1, marker
    text = "".join(piece for piece, _ in chat.render(CONVERSATION, chat.KimiChat(), SCHEMAS))
    ids = tok.encode(text)
    assert tok.decode(ids) == text and int((ids >= 262).sum()) == sum(text.count(m) for m in chat.KimiChat.markers)
    assert chat.format_for(tok) == "kimi" and chat.format_for(ByteTokenizer()) == "plain"
    with pytest.raises(ValueError, match="chat format 'kimi' needs <.tool_calls_section_begin.>"):
        chat.format_for(ByteTokenizer(), "kimi")


def test_byte_tokenizer_json_encodes_as_the_byte_tokenizer():
    text = "héllo\n\x00 <|im_end|> 🎉\r\n\t"
    tok = Tokenizer.from_str(byte_tokenizer_json())
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == ByteTokenizer().encode(text).tolist() and tok.decode(ids) == text and tok.get_vocab_size() == 256
    assert np.array_equal(chat.tokenize_conversation(CONVERSATION, ByteTokenizer().encode)[0],
                          np.asarray(tok.encode("".join(p for p, _ in chat.render(CONVERSATION)),
                                                add_special_tokens=False).ids))
