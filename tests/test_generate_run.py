"""`composer-jax generate RUN_DIR`: a training run's latest checkpoint and tokenizer (byte-level here),
streamed as text."""

import pytest

from composer_jax import cli
from composer_jax.data.tokenizer import ByteTokenizer
from composer_jax.infer import generate
from composer_jax.source_weights import open_model
from tests.random_models import save_random_run

PROMPT = "def add(a, b):\n    "


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory with one checkpoint (step 3) of a pretraining state with random weights."""
    return save_random_run(tmp_path_factory.mktemp("run"))


def test_generate_streams_a_runs_text(run_dir, capsys):
    argv = ["generate", str(run_dir), "--prompt", PROMPT, "temperature=0", "max_new_tokens=12", "max_slots=1",
            "steps_per_call=16"]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    opened = open_model(run_dir)
    assert opened.description == f"training run {run_dir}, step 3" and opened.eos_ids == ()
    want = generate(opened.model, [list(ByteTokenizer().encode(PROMPT))], max_new_tokens=12, temperature=0.0)
    assert len(want.tokens[0]) == 12
    assert out == ByteTokenizer().decode(want.tokens[0]) + "\n"
    assert f"training run {run_dir}, step 3" in err and "generated 12 tokens" in err


def test_run_without_checkpoints_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    assert cli.main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"composer-jax generate: error: {tmp_path}: no complete checkpoint in {tmp_path / 'checkpoints'}: "
                   "train that run first")


def test_generate_samples_as_the_run_recorded(run_dir, tmp_path, capsys):
    """A run's recorded agent settings (chat.json: greedy, 12 new tokens) are generate's defaults."""
    import json
    import shutil

    run = shutil.copytree(run_dir, tmp_path / "run")
    (run / "chat.json").write_text(json.dumps({"tokenizer": "byte", "format": "plain",
                                               "agent": {"temperature": 0.0, "max_new_tokens": 12}}))
    assert cli.main(["generate", str(run), "--prompt", PROMPT, "max_slots=1", "steps_per_call=16"]) == 0
    out = capsys.readouterr().out
    want = generate(open_model(run_dir).model, [list(ByteTokenizer().encode(PROMPT))], max_new_tokens=12,
                    temperature=0.0)
    assert out == ByteTokenizer().decode(want.tokens[0]) + "\n"
