"""Parameter/FLOP accounting (`composer_jax.model.accounting`) and the `composer-jax info` command.

Reference numbers come from shared/reference/kimi_arch.md 1.3 and 5 (counted from HF tensor shapes),
not from this code; the FLOP check re-derives the formula by hand from the config fields.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx

from composer_jax.cli import human, main
from composer_jax.config import load_config
from composer_jax.model import CausalLM
from composer_jax.model.accounting import abstract_model, leaves, model_info

ROOT = Path(__file__).resolve().parent.parent
K25_TOTAL = 1_026_408_232_448


@pytest.fixture(scope="module")
def k25():
    return model_info(load_config("kimi-k2.5"))


@pytest.fixture(scope="module")
def dsv3():
    return model_info(load_config("deepseek-v3"))


def test_kimi_k25_totals(k25):
    assert k25.total == pytest.approx(K25_TOTAL, rel=0.01)
    assert k25.mtp == 0 and k25.total == k25.main
    assert k25.active == pytest.approx(32.86e9, rel=0.01)
    assert k25.active_no_embed == pytest.approx(31.69e9, rel=0.01)


def test_kimi_k25_components_match_reference_table(k25):
    c = k25.components
    expert, moe_layer, attn_layer = 44_040_192, 16_958_226_816, 101_124_096  # kimi_arch.md 1.3
    assert c["embedding"] == c["lm_head"] == 1_174_405_120
    assert c["dense_ffn"] == 396_361_728
    assert c["routed_experts"] == 60 * 384 * expert
    assert c["shared_experts"] == 60 * expert
    assert c["routed_experts"] + c["shared_experts"] + c["router"] == 60 * moe_layer
    # The reference counts the q/kv latent norms (1536 + 512) as attention; here they are norms.
    assert c["attention"] == 61 * (attn_layer - 1536 - 512)
    assert c["norms"] == 61 * (2 * 7168 + 1536 + 512) + 7168


def test_deepseek_v3_totals(dsv3):
    assert dsv3.main == pytest.approx(671.03e9, rel=0.01)
    assert dsv3.mtp == pytest.approx(11.6e9, rel=0.01)
    assert dsv3.total == dsv3.main + dsv3.mtp
    # Embedding and head are shared with the main model: not counted again in the MTP module.
    assert "embedding" not in dsv3.mtp_components and "lm_head" not in dsv3.mtp_components
    assert dsv3.mtp_components["mtp_proj"] == 2 * 7168 * 7168
    assert dsv3.active == pytest.approx(37.5e9, rel=0.01)  # "37B activated" (DeepSeek-V3 report)


@pytest.mark.parametrize("name", ["tiny", "kimi-k2.5", "deepseek-v3"])
def test_breakdown_is_complete(name):
    info = model_info(load_config(name))
    assert "other" not in info.components and "other" not in info.mtp_components
    assert sum(info.components.values()) == info.main
    assert sum(info.mtp_components.values()) == info.mtp


def test_tiny_exact_counts():
    info = model_info(load_config("tiny"))
    assert (info.main, info.mtp, info.total) == (454_576, 135_584, 590_160)
    more = model_info(load_config("tiny", ["mtp.num_layers=2"]))
    assert more.mtp == 2 * 135_584 and more.main == info.main


def test_abstract_counts_equal_concrete_model():
    cfg = load_config("tiny")
    abstract = abstract_model(cfg)
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves(nnx.state(abstract)))
    concrete = CausalLM(cfg, rngs=nnx.Rngs(0))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(concrete))) == 590_160
    assert leaves(abstract) == leaves(concrete)


def _tiny_flops_by_hand(cfg, seq: int) -> tuple[int, int]:
    """(main, mtp) training FLOPs per token, written out from the config fields."""
    d, m, moe, V = cfg.hidden_size, cfg.mla, cfg.moe, cfg.vocab_size
    H, dn, dr, dv = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    rq, rkv = m.q_lora_rank, m.kv_lora_rank
    attn = d * rq + rq * H * (dn + dr) + d * (rkv + dr) + rkv * H * (dn + dv) + H * dv * d
    dense_ffn = 3 * d * cfg.intermediate_size
    expert = 3 * d * moe.moe_intermediate_size
    moe_active = (moe.num_experts_per_tok + moe.n_shared_experts) * expert + d * moe.n_routed_experts
    head = d * V
    scores = 2 * seq * H * (dn + dr) + 2 * seq * H * dv  # forward QK^T + AV for a full (non-causal) row
    layer_attn = 3 * scores // 2                          # causal halves it; backward doubles the forward
    n_moe = cfg.num_layers - cfg.num_dense_layers
    main = 6 * (cfg.num_layers * attn + cfg.num_dense_layers * dense_ffn + n_moe * moe_active + head)
    main += cfg.num_layers * layer_attn
    mtp = cfg.mtp.num_layers * (6 * (2 * d * d + attn + moe_active + head) + layer_attn)
    return main, mtp


@pytest.mark.parametrize("seq", [None, 64])
def test_tiny_flops_match_hand_formula(seq):
    cfg = load_config("tiny")
    flops = model_info(cfg, seq).flops
    assert flops.seq_len == (seq or cfg.rope.original_max_position_embeddings)
    main_ref, mtp_ref = _tiny_flops_by_hand(cfg, flops.seq_len)
    assert (flops.main, flops.mtp, flops.total) == (main_ref, mtp_ref, main_ref + mtp_ref)


def test_human_units():
    assert human(K25_TOTAL) == "1.03T"
    assert human(32_861_500_928) == "32.9B"
    assert human(671_026_419_200) == "671B"
    assert human(896) == "896" and human(0) == "0"


# ----------------------------------------------------------------------------------------------------
# CLI


def test_cli_info_table(capsys):
    assert main(["info", "kimi-k2.5"]) == 0
    out = capsys.readouterr().out
    for text in ("1,026,408,232,448", "1.03T", "32,861,500,928", "32.9B", "seq len 4,096"):
        assert text in out


def test_cli_info_json_overrides_and_seq_len(capsys):
    # Overrides may follow options.
    assert main(["info", "tiny", "--json", "--seq-len", "32", "mtp.num_layers=2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total"] == 454_576 + 2 * 135_584
    assert data["flops"]["seq_len"] == 32
    assert data["flops"]["total"] == sum(_tiny_flops_by_hand(load_config("tiny", ["mtp.num_layers=2"]), 32))


@pytest.mark.parametrize("argv, needle", [
    (["info", "tiny", "mla.num_heds=8"], "mla.num_heds"),
    (["info", "tiny", "--json", "moe.num_experts_per_tok=99"], "moe.num_experts_per_tok"),
    (["info", "no-such-config"], "no-such-config"),
    (["info", "tiny", "--seq-len", "4096"], "max_position_embeddings"),
])
def test_cli_errors_exit_2_with_one_line(capsys, argv, needle):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert needle in captured.err and "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1


def test_cli_usage_errors_exit_2():
    for argv in ([], ["info"], ["info", "tiny", "--seq-len", "0"], ["info", "tiny", "--bogus"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2


def _run_cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "composer_jax.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_subprocess():
    proc = _run_cli("info", "configs/model/kimi-k2.5.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "1,026,408,232,448" in proc.stdout and "1.03T" in proc.stdout and "32.9B" in proc.stdout


def test_cli_subprocess_bad_override():
    proc = _run_cli("info", "configs/model/kimi-k2.5.yaml", "moe.n_routed_expert=8")
    assert proc.returncode == 2
    assert "moe.n_routed_expert" in proc.stderr and "Traceback" not in proc.stderr
