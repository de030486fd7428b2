"""`composer-jax pretrain` / `sft` input errors: one line naming the culprit, exit status 2."""

import pytest

from composer_jax import cli


@pytest.mark.parametrize("argv, message", [
    (["pretrain", "data.path=/no/such/dir"], "composer-jax pretrain: error: data path /no/such/dir does not exist"),
    (["pretrain", "train.seq_len=1024"], "config key 'train.seq_len': 1024 is longer than the model supports "
                                         "(model.rope.max_position_embeddings=128)"),
    (["pretrain", "pretrain-tiny", "data.tokenizer=/no/tokenizer.json"],
     "composer-jax pretrain: error: tokenizer file /no/tokenizer.json does not exist"),
    (["sft", "pretrain-tiny"], "config key 'data.format': sft trains on conversations"),
    (["pretrain", "no-such-run-config"], "config 'no-such-run-config' is neither a file nor a bundled"),
    (["pretrain", "train.batch_size=12"], "config key 'train.batch_size': the micro-batch of 12 rows"),
])
def test_bad_inputs_are_one_line_errors(argv, message, capsys, tmp_path):
    assert cli.main(argv + [f"run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
