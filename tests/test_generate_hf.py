"""`generate` and `composer-jax generate` against transformers' DeepseekV3ForCausalLM: a tiny random
checkpoint saved with `save_pretrained` (plus a byte-level tokenizer.json), loaded with
`from_pretrained`; greedy tokens equal transformers' own greedy `generate`, sampled tokens' log-probs
equal its log-softmax over prompt + sample. Also the CLI's outputs and its one-line errors."""

import copy
import json
import shutil

import numpy as np
import pytest
import torch
from scipy.special import log_softmax
from tokenizers import Tokenizer

from composer_jax import cli, from_pretrained, load_config
from composer_jax import generate
from composer_jax.checkpoint.quant import dequant_int4, quantize_int4
from tests.hf_reference import save_random_hf_model
from tests.sampling_reference import sampling_probs

PROMPT_LENGTHS = (4, 9, 15)
NEW_TOKENS = 10


def save_byte_tokenizer(directory) -> None:
    """A tokenizer.json mapping each byte to one id (0..255, as the tiny vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    hf_model = save_random_hf_model(load_config("tiny", ["mtp.num_layers=0"]), path, seed=1)
    save_byte_tokenizer(path)
    return path, hf_model, from_pretrained(path)


def _prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(2, 256, n).tolist() for n in PROMPT_LENGTHS]


def test_greedy_generation_equals_transformers(checkpoint):
    path, hf_model, model = checkpoint
    assert model.eos_token_ids == (hf_model.generation_config.eos_token_id,) == (1,)
    ours = generate(model, _prompts(), max_new_tokens=NEW_TOKENS, temperature=0.0)
    for prompt, tokens, reason in zip(_prompts(), ours.tokens, ours.finish_reasons):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        reference = out[0, len(prompt):].tolist()
        assert tokens == reference
        assert reason == ("stop" if reference[-1] == 1 else "length")


def test_int4_experts_decode_as_transformers_does_on_their_dequantized_weights(checkpoint):
    """`model.moe.expert_quant=int4` on the float checkpoint against transformers with every routed expert
    replaced by its K2.5 INT4 round trip (quantize_int4, then the reader's dequant_int4, per [out, in]
    matrix): the same logits (where the float experts' differ) and the same greedy tokens."""
    path, hf_model, _ = checkpoint
    model = from_pretrained(path, ["moe.expert_quant=int4"])
    reference = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if ".mlp.experts." in name:        # fused [experts, out, in]
                w = param.float().numpy()
                param.copy_(torch.from_numpy(np.stack([dequant_int4(*quantize_int4(m, 32), m.shape[1], 32) for m in w])))
    tokens = torch.tensor([_prompts()[-1]])
    with torch.no_grad():
        want, float_logits = reference(tokens).logits[0].numpy(), hf_model(tokens).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(model(tokens.numpy()))[0], want, rtol=1e-4, atol=1e-4)
    assert not np.allclose(float_logits, want, rtol=1e-4, atol=1e-4)
    ours = generate(model, _prompts(), max_new_tokens=NEW_TOKENS, temperature=0.0)
    for prompt, got in zip(_prompts(), ours.tokens):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert got == out[0, len(prompt):].tolist()


def test_sampled_logprobs_equal_transformers_log_softmax(checkpoint):
    """Raw log-probs: log_softmax of transformers' logits over prompt + sample at each sampled token
    (temperature 1, untruncated); behaviour log-probs: the same logits through the NumPy statement of
    temperature 0.8 / top-k 40 / top-p 0.95."""
    path, hf_model, model = checkpoint
    ours = generate(model, _prompts(), max_new_tokens=NEW_TOKENS, temperature=0.8, top_k=40, top_p=0.95, seed=5,
                    stop_tokens=[])
    assert [len(t) for t in ours.tokens] == [NEW_TOKENS] * len(PROMPT_LENGTHS)
    for prompt, tokens, logprobs, behaviour in zip(_prompts(), ours.tokens, ours.logprobs, ours.behaviour_logprobs):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + tokens])).logits[0].double().numpy()
        at = logits[len(prompt) - 1:-1]                                          # the logits each token was drawn from
        reference = log_softmax(at, axis=-1)
        np.testing.assert_allclose(logprobs, reference[np.arange(NEW_TOKENS), tokens], atol=1e-4)
        processed = [np.log(sampling_probs(row, 0.8, 40, 0.95)[t]) for row, t in zip(at, tokens)]
        np.testing.assert_allclose(behaviour, processed, atol=1e-4)


def test_cli_writes_json_lines_equal_to_generate(checkpoint, tmp_path, capsys):
    path, _, model = checkpoint
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps(r) for r in (
        {"tokens": _prompts()[0]}, {"prompt": "def add(a, b):"}, {"tokens": _prompts()[2]})) + "\n")
    out = tmp_path / "out.jsonl"
    assert cli.main(["generate", str(path), "--prompts", str(prompts_file), "--out", str(out), "temperature=0",
                     f"max_new_tokens={NEW_TOKENS}", "max_slots=3", "steps_per_call=16"]) == 0  # generate()'s shapes
    records = [json.loads(line) for line in out.read_text().splitlines()]
    text_ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode("def add(a, b):").ids
    want = generate(model, [_prompts()[0], text_ids, _prompts()[2]], max_new_tokens=NEW_TOKENS, temperature=0.0)
    assert [r["tokens"] for r in records] == want.tokens
    assert [r["source"] for r in records] == [f"{prompts_file} line {n}" for n in (1, 2, 3)]
    np.testing.assert_allclose(records[1]["logprobs"], want.logprobs[1], atol=1e-5)
    assert "text" in records[0] and "tokens/s" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--prompt", ""], "--prompt: prompt is empty"),
    (["--prompt", "x" * 40, "max_len=32"], "--prompt: prompt of 40 tokens does not fit the cache: max_len=32"),
    (["--prompt", "x", "max_new_tokens=0"], "config key 'max_new_tokens': must be > 0, got 0"),
    (["--prompt", "x", "temprature=0"], "did you mean 'temperature'"),
    (["--prompt", "x", "model.moe.dispach=dense"], "did you mean 'dispatch'"),
    (["--prompts", "{prompts}"], "line 2: prompt: token id 256 is out of the vocabulary [0, 256)"),
    (["--prompts", "{bad_json}"], "line 1: not JSON"),
])
def test_cli_errors_are_one_line(checkpoint, tmp_path, capsys, argv, message):
    path = checkpoint[0]
    (tmp_path / "p.jsonl").write_text('{"tokens": [1, 2]}\n{"tokens": [5, 256]}\n')
    (tmp_path / "bad.jsonl").write_text("{tokens\n")
    argv = [a.format(prompts=tmp_path / "p.jsonl", bad_json=tmp_path / "bad.jsonl") for a in argv]
    assert cli.main(["generate", str(path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("composer-jax generate: error: ") and "\n" not in err and message in err, err


def test_cli_text_prompt_needs_a_tokenizer(checkpoint, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(checkpoint[0], bare)
    (bare / "tokenizer.json").unlink()
    assert cli.main(["generate", str(bare), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert "text prompts need a tokenizer" in err and str(bare) in err and "\n" not in err
    assert cli.main(["generate", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err
