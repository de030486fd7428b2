"""The recipe joined: each phase starts from the previous phase's output with the checkpoint's own tokenizer
and chat format, and the export carries them. Two chains, each phase a `composer-jax` process as a user runs
it: a Hugging Face checkpoint through pretraining, SFT and RL at learning rate 0 (the exported model's logits
and tokenizer equal the original's), and the bundled tiny recipe of the README at a few steps."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from tokenizers import Tokenizer
from transformers import AutoTokenizer, DeepseekV3ForCausalLM

from composer_jax import config, load_config
from composer_jax.config import CONFIG_DIR
from composer_jax.cpu_devices import without_device_count
from composer_jax.envs import TOOLS, get_format
from tests.hf_reference import save_random_hf_model
from tests.test_chat import CONVERSATION
from tests.test_train import write_code_tree

REPO = Path(__file__).resolve().parents[1]
TINY_BPE = CONFIG_DIR / "tokenizers" / "tiny-bpe"
SCHEMAS = [t.schema() for t in TOOLS]
# ChatML with Hermes-style tool calls, written here on its own as the original checkpoint's template: the
# exported template (composer_jax.data.chat's plain format) must render conversations exactly as it does.
REFERENCE_TEMPLATE = """\
{%- macro sig(f) -%}{{ f.name }}(
{%- for name, p in f.parameters.properties.items() -%}{{ ', ' if not loop.first }}{{ name }}
{{- '' if name in f.parameters.required else '?' }}: {{ p.type }}{%- endfor -%}){%- endmacro -%}
{%- if tools -%}{{ '<|im_start|>system\\nTools (call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>):' }}
{%- for t in tools -%}{{ '\\n- ' ~ sig(t.function) ~ ': ' ~ t.function.description }}{%- endfor -%}
{{ '<|im_end|>\\n' }}{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- set ns = namespace(parts=[m.content] if m.content else []) -%}
{%- for c in m.tool_calls or [] -%}
{%- set ns.parts = ns.parts + ['<tool_call>{"name": ' ~ (c.function.name | tojson) ~ ', "arguments": ' ~
    (c.function.arguments if c.function.arguments is string else c.function.arguments | tojson) ~ '}</tool_call>'] -%}
{%- endfor -%}{{ '<|im_start|>assistant\\n' ~ ns.parts | join('\\n') ~ '<|im_end|>\\n' }}
{%- else -%}{{ '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' }}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"""


SHORT = [{"role": "user", "content": "List the files."},
         {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "function": {"name": "list_dir", "arguments": {}}}]},
         {"role": "tool", "tool_call_id": "a", "content": "a.py"},
         {"role": "assistant", "content": "Done.", "tool_calls": [{"id": "b", "function": {"name": "submit", "arguments": {}}}]}]


def _cli(*argv, env=None, timeout=900) -> subprocess.CompletedProcess:
    """`composer-jax ARGV` as a user runs it: the config's own fake device count (cpu_devices)."""
    flags = without_device_count(os.environ.get("XLA_FLAGS", ""))
    result = subprocess.run([sys.executable, "-m", "composer_jax.cli", *map(str, argv)], capture_output=True,
                            text=True, timeout=timeout, cwd=REPO,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, **(env or {})})
    assert result.returncode == 0, f"{argv}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def _yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
def test_a_checkpoint_through_every_phase_at_learning_rate_zero_exports_unchanged(tmp_path):
    """HF directory -> pretrain 2 steps -> SFT on tool-call conversations 2 steps -> RL 2 steps -> export, with
    optimizer.lr=0 and rl.optimizer.lr=0 (and no router-bias update): the exported checkpoint gives the
    original's logits in transformers (1e-5), its tokenizer encodes and renders a conversation with tool
    calls as the original's does, and the RL episodes' prompt ids are the original tokenizer's encoding of
    what the environment rendered."""
    hf = tmp_path / "hf"
    cfg = config.replace(load_config("tiny"), **{"mtp.num_layers": 0, "vocab_size": 4096})
    original = save_random_hf_model(cfg, hf)
    (hf / "tokenizer.json").write_bytes((TINY_BPE / "tokenizer.json").read_bytes())
    tokenizer_config = json.loads((TINY_BPE / "tokenizer_config.json").read_text())
    (hf / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": REFERENCE_TEMPLATE}))
    frozen = {"optimizer": {"lr": 0.0, "warmup_steps": 0}, "model.moe.bias_update_rate": 0.0}
    train = {"steps": 2, "batch_size": 8, "log_every": 1, "progress": False, "cpu_devices": 8}
    pre = _yaml(tmp_path / "pre.yaml", {**frozen, "run_dir": str(tmp_path / "pre"),
                                        "train": {**train, "init_from": str(hf), "seq_len": 64},
                                        "data": {"path": str(write_code_tree(tmp_path / "code")),
                                                 "eval_fraction": 0.0}})
    _cli("pretrain", pre)
    chats = tmp_path / "chats.jsonl"     # short tool-use conversations: the source has 64 positions
    chats.write_text("".join(json.dumps({"messages": SHORT}) + "\n" for _ in range(8)))
    sft = _yaml(tmp_path / "sft.yaml", {**frozen, "run_dir": str(tmp_path / "sft"),
                                        "train": {**train, "init_from": str(tmp_path / "pre"), "seq_len": 64},
                                        "data": {"kind": "jsonl", "path": str(chats), "format": "chat",
                                                 "eval_fraction": 0.0},
                                        "agent": {"tools": ["read_file", "list_dir", "edit", "submit"]}})
    _cli("sft", sft)
    rl_run = tmp_path / "rl"
    _cli("rl", "rl-tiny", f"init_from={tmp_path / 'sft'}", f"run_dir={rl_run}", "rl.optimizer.lr=0", "rl.steps=2",
         "rollout.batch_size=8", "rl.group_size=4", "rollout.max_len=64", "rollout.feedback_window=64", "env.eval_tasks=2", "eval.every=2",
         "progress=false")
    records = [json.loads(line) for line in (rl_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    _cli("export", rl_run, tmp_path / "out", "--quiet")

    exported = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    tokens = torch.as_tensor(np.random.default_rng(0).integers(0, 4096, (2, 40)))
    with torch.no_grad():
        np.testing.assert_allclose(exported(tokens).logits.numpy(), original(tokens).logits.numpy(), rtol=1e-5,
                                   atol=1e-5)
    theirs, ours = AutoTokenizer.from_pretrained(hf), AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "def f(x):\n    return x  # ünïcode <|im_end|>"
    assert ours(text, add_special_tokens=False)["input_ids"] == theirs(text, add_special_tokens=False)["input_ids"]
    for prompt in (False, True):
        assert ours.apply_chat_template(CONVERSATION, tools=SCHEMAS, tokenize=False, add_generation_prompt=prompt) == \
            theirs.apply_chat_template(CONVERSATION, tools=SCHEMAS, tokenize=False, add_generation_prompt=prompt)
    recorded = json.loads((tmp_path / "out" / "chat.json").read_text())
    assert recorded["format"] == "plain" and "tools" not in recorded["agent"]   # a toy RL run declares no tool

    # The held-out episodes of RL (toy tasks): the prompt ids are the original tokenizer's encoding of the
    # environment's rendering, and the run kept that tokenizer.
    original_tokenizer, fmt = Tokenizer.from_file(str(hf / "tokenizer.json")), get_format("plain")
    transcripts = sorted((rl_run / "eval" / "step-2" / "transcripts").rglob("*.json"))
    assert transcripts
    for path in transcripts:
        transcript = json.loads(path.read_text())
        prompt = fmt.message("user", transcript["text"].split("\n", 1)[1].split("<|im_end|>")[0]) + \
            fmt.generation_prompt()
        start = transcript["turns"][0]["start"]
        assert transcript["tokens"][:start] == original_tokenizer.encode(prompt, add_special_tokens=False).ids
        assert original_tokenizer.decode(transcript["tokens"], skip_special_tokens=False) == transcript["text"]
    assert (rl_run / "tokenizer" / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()


@pytest.mark.slow
def test_the_bundled_tiny_recipe_runs_phase_to_phase(tmp_path):
    """The README's "whole recipe" with its bundled configs, a few steps each: pretrain-tiny,
    long-context-tiny, tasks and demonstrations from textkit, sft-tiny, rl-coding-tiny (episodes of 2 turns of
    64 tokens), eval of the SFT and RL runs on the held-out tasks, eval compare, export. Every phase starts
    from the run before (its model, tokenizer and chat format; the SFT run's agent settings reach RL, and
    each run's reach its eval)."""
    env = {"HOME": str(tmp_path / "home")}                  # the bundled runs live in ~/.cache/composer-jax
    cache = tmp_path / "home" / ".cache" / "composer-jax"
    tasks, demos = cache / "tasks" / "textkit", cache / "data" / "textkit-demos.jsonl"
    few = ["train.steps=2", "train.log_every=1", "train.progress=false"]
    no_eval = ["data.eval_fraction=0"]       # the held-out loss compiles a program of its own: not needed here
    _cli("pretrain", *few, *no_eval, env=env)
    _cli("pretrain", "long-context-tiny", *few, *no_eval, env=env)
    _cli("tasks", "feature-deletion", CONFIG_DIR / "repos" / "textkit", tasks, "--held-out", "4", env=env)
    _cli("tasks", "demos", tasks, demos, "--tools", "read_file,edit,run,submit", "--max-output-chars", "1000", env=env)
    _cli("sft", *few, env=env)
    # One RL step of shorter episodes (its own agent settings, which its eval below must then use); eval: below
    _cli("rl", "rl-coding-tiny", "rl.steps=1", "eval.every=0", "progress=false", "rollout.max_new_tokens=64",
         "env.max_turns=2", env=env)
    runs = cache / "runs"
    for run in ("pretrain-tiny", "long-context-tiny", "sft-tiny", "rl-coding-tiny"):
        assert json.loads((runs / run / "chat.json").read_text())["format"] == "plain", run
        assert (runs / run / "tokenizer" / "tokenizer.json").read_bytes() == (TINY_BPE / "tokenizer.json").read_bytes()
    rl_agent = json.loads((runs / "rl-coding-tiny" / "chat.json").read_text())["agent"]
    assert rl_agent["tools"] == ["read_file", "edit", "run", "submit"] and rl_agent["max_output_chars"] == 1000
    held_out = tasks / "held-out" / "textkit.word_count"       # one of the four: a few minutes less
    for run, turns, tokens in (("sft-tiny", 6, 256), ("rl-coding-tiny", 2, 64)):   # each run's recorded settings
        _cli("eval", runs / run, held_out, "--out", tmp_path / f"eval-{run}", "--quiet", env=env)
        spec = json.loads((tmp_path / f"eval-{run}" / "run.json").read_text())
        assert spec["tools"] == ["read_file", "edit", "run", "submit"] and spec["max_turns"] == turns
        assert spec["agent_settings"]["temperature"] == 0.7 and spec["agent_settings"]["max_new_tokens"] == tokens
    compared = _cli("eval", "compare", tmp_path / "eval-sft-tiny", tmp_path / "eval-rl-coding-tiny", env=env)
    assert "pass@1" in compared.stdout
    _cli("export", runs / "rl-coding-tiny", tmp_path / "exported", "--quiet", env=env)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
