"""RL with an INT4 rollout engine (`rollout.weights=int4`): the engine samples with the routed experts
through K2.5's INT4 quantizer while the learner keeps float experts, and the step reports how far the
engine's token log-probs are from the learner's (behaviour_logp_gap, _max). Quantization-aware RL
(`model.moe.expert_quant=int4` on the learner) trains the engine's own policy: the gap is float rounding,
as with a float engine over a float learner (measured: max 9.5e-7 both; the INT4 engine over float
experts: mean 3.0e-3, max 1.1e-2)."""

import pytest

from composer_jax.config import ConfigError
from composer_jax.rl.loop import RLTrainer
from tests.rl_parity import parity_tasks
from tests.test_rl_loop import _config, _records


@pytest.mark.slow
def test_an_int4_engine_reports_its_gap_and_quantization_aware_rl_closes_it(tmp_path):
    gaps = {}
    for name, extra in (("int4 engine", ["rollout.weights=int4"]),
                        ("quantization-aware", ["rollout.weights=int4", "model.moe.expert_quant=int4"])):
        cfg = _config(tmp_path / name.replace(" ", "-"), "rl.max_staleness=0", "rl.steps=1", *extra)
        RLTrainer(cfg, parity_tasks()).run()
        record, = _records(cfg.run_dir)
        gaps[name] = record["behaviour_logp_gap"], record["behaviour_logp_gap_max"]
    rounding = gaps["quantization-aware"][1]
    assert rounding < 1e-5, gaps
    assert gaps["int4 engine"][0] > 100 * rounding and gaps["int4 engine"][1] > 1000 * rounding, gaps


def test_an_int4_engine_needs_expert_widths_it_can_quantize(tmp_path):
    with pytest.raises(ConfigError, match="rollout.weights.*int4 needs"):
        _config(tmp_path, "rollout.weights=int4", "model.moe.moe_intermediate_size=24")
