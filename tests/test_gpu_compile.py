"""The GPU path built by XLA's GPU compiler on a machine without a GPU (plan/gpu_compile.py), for 2
hosts x 8 H100s: the training step with cuDNN attention (MLA's unequal head dims, packed documents)
on the dual grid, its handoff between the grids and ep_ragged's ragged_all_to_all; the RL step with
Muon's exchange; the engine's prefill and decode; and the HLO reading the report rests on. Each
program is built once per module (XLA's GPU build of even the tiny model takes seconds: one ptxas run
per kernel) and shared by the checks on it.

The compiles need the cuda12 extra (pip install -e '.[cuda12]'): without it they fail under CI (where
the extra is installed) and are skipped elsewhere, naming the extra."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

from composer_jax.config import ConfigError
from composer_jax.model.transformer import head_logits
from composer_jax.plan import activations as act
from composer_jax.plan import gpu_compile, hlo
from composer_jax.rl import losses as rl_losses
from composer_jax.rl.objective import _token_stats
from composer_jax.rl.rows import chunked
from composer_jax.train.losses import head_loss_sums

# The tiny model cut to one dense and one MoE layer, no MTP (each kernel costs XLA a ptxas run: fewer
# layers, fewer kernels), bf16 with MLA's unequal head dims (q/k 24, v 16), ep_ragged, on 2 hosts x 8:
# dense grid fsdp=16, expert grid ereplica=2 x ep=8.
TINY = ["model.dtype=bfloat16", "model.mla.v_head_dim=16", "model.num_layers=2", "model.mtp.num_layers=0",
        "model.moe.dispatch=ep_ragged", "train.batch_size=16", "train.seq_len=64", "mesh.fsdp=16",
        "mesh.ereplica=2", "mesh.ep=8"]


def _plugin() -> bool:
    return importlib.util.find_spec("jax_plugins") is not None and \
        importlib.util.find_spec("jax_plugins.xla_cuda12") is not None


@pytest.fixture(scope="module")
def h100s():
    if not _plugin():
        why = f"the CUDA compiler plugin is not installed: {gpu_compile.EXTRA}"
        pytest.fail(why) if os.environ.get("CI") else pytest.skip(why)
    return gpu_compile.gpu_devices("h100", 2, 8)


def _config(*overrides):
    from composer_jax.plan.report import load_plan_config

    return load_plan_config("pretrain-tiny", [*TINY, *overrides])


@pytest.fixture(scope="module")
def train_step(h100s):
    """One training step (cuDNN attention over packed documents, AdamW) built once for the tests below."""
    return gpu_compile.compile_train(_config("model.attention=cudnn"), h100s)


@pytest.fixture(scope="module")
def rl_step(h100s):
    """One RL step with Muon and one teacher window of 16 tokens per row, built once."""
    return gpu_compile.compile_rl(_config("optimizer.name=muon"), h100s, slots=1, window=16)


def test_groups_in_all_three_spellings_and_loop_trip_counts_by_hand():
    grids = (hlo.Grid("dense", ("fsdp", "cp"), (4, 2)), hlo.Grid("expert", ("ereplica", "ep"), (2, 4)))
    text = """%body (p: f32[8]) -> f32[8] {
  %ag = f32[8,16]{1,0} all-gather(%p), replica_groups=[4,2]<=[8], dimensions={0}
  %a2a-start = ((f32[4,4]{1,0}), f32[4,4]{1,0}) all-to-all-start(%p), replica_groups=mesh['a'=2,'b'=4] {'b'}
  %a2a-done = f32[4,4]{1,0} all-to-all-done(%a2a-start)
}
ENTRY %main (x: f32[8]) -> f32[8] {
  %w = f32[8] while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = bf16[2]{0} reduce-scatter(%x), replica_groups={{0,2,4,6},{1,3,5,7}}, dimensions={0}
  %cc = f32[1] custom-call(%x), custom_call_target="__cudnn$fmhaSoftmax"
}
"""
    s = hlo.summarize(text, 8, grids)
    # [4,2]<=[8]: pairs {0,1},{2,3}..: the dense grid's cp; 3 trips of 8*16*4 bytes
    assert s.collectives[("all-gather", "dense:cp")] == hlo.Collective(3, 3 * 512)
    # mesh a=2,b=4 over b: {0..3},{4..7}: the expert grid's ep (the dense grid: fsdp 2 of 4, no slice)
    assert s.collectives[("all-to-all", "expert:ep")] == hlo.Collective(3, 3 * 64)
    # {0,2,4,6}: dense fsdp (cp fixed); expert: ereplica+ep mixed, no slice
    assert s.collectives[("reduce-scatter", "dense:fsdp")] == hlo.Collective(1, 4)
    assert s.custom_calls == {"__cudnn$fmhaSoftmax": 1}
    np.testing.assert_array_equal(hlo.device_groups("x replica_groups=[2,4]<=[4,2]T(1,0)", 8),
                                  [[0, 2, 4, 6], [1, 3, 5, 7]])


def test_compile_for_without_the_plugin_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith("jax_plugins") else real(name, *a))
    with pytest.raises(ConfigError, match=r"--compile-for.*pip install -e '\.\[cuda12\]'"):
        gpu_compile.gpu_devices("h100", 2, 8)


@pytest.mark.slow
def test_train_step_has_cudnn_attention_forward_and_backward(train_step):
    """attention: cudnn with MLA's unequal head dims over packed documents, on the dual grid (which
    JAX's own cuDNN entry point cannot lower: both meshes in one program): cuDNN's fused attention
    forward and backward are in the HLO, one of each per layer."""
    calls = train_step.summary.custom_calls
    assert calls.get("__cudnn$fmhaSoftmax") == 2 and calls.get("__cudnn$fmhaSoftmaxBackward") == 2, calls


@pytest.mark.slow
def test_train_step_grid_handoff_adds_no_collective(train_step):
    """ep_ragged over ep=8: the only exchanges (all-to-all, ragged all-to-all, collective-permute) are
    the dispatch's, over the expert grid's ep; moving activations between the grids adds none."""
    kinds = set(train_step.summary.collectives)
    exchanges = {span for kind, span in kinds if kind in ("all-to-all", "ragged-all-to-all", "collective-permute")}
    assert exchanges == {"expert:ep"}, kinds
    assert train_step.summary.total("ragged-all-to-all").count > 0
    assert not any(kind == "collective-permute" for kind, _ in kinds)


@pytest.mark.slow   # the RL step's GPU build: about 21 s on 2 cores
def test_rl_step_with_muon_compiles_its_exchange(rl_step):
    """Muon's orthogonalization exchange (an all-to-all of the dense weights' stacks over the dense
    grid's fsdp axis) and the ragged dispatch are built in the RL step."""
    spans = {span for kind, span in rl_step.summary.collectives if kind == "all-to-all"}
    assert any(span.startswith("dense:fsdp") for span in spans), rl_step.summary.collectives
    assert {span for kind, span in rl_step.summary.collectives if kind == "ragged-all-to-all"} == {"expert:ep"}
    assert rl_step.total > 0


def test_planner_total_is_within_15_percent_of_the_gpu_build(train_step):
    """The planner's per-device total for the training step (bf16; its peak the chunked loss's blocks and
    the head's copies at 64 tokens a device) against XLA's GPU build: arguments + outputs - aliased +
    temporaries (1.58 before the loss's blocks were measured, tests below)."""
    assert train_step.ratios()["expanded"] == pytest.approx(1.0, rel=0.15)


def test_rl_planner_total_is_within_15_percent_of_the_gpu_build(rl_step):
    """The same for the RL step (Muon, one feedback window of 16 tokens a row; its peak the policy
    gradient's and the self-distillation's blocks beside the teacher's forward): 1.61 before the
    losses' blocks were measured."""
    assert rl_step.ratios()["expanded"] == pytest.approx(1.0, rel=0.15)


@pytest.mark.slow
def test_planner_state_equals_the_compiled_arguments(train_step):
    """The state the planner lays out per device (parameters, biases, optimizer moments) and the batch
    (four int32 features of 16 x 64 tokens over 16 devices) are what XLA's GPU build takes as its
    arguments, all donated: aliased to the outputs."""
    batch = 4 * 4 * 16 * 64 // 16
    for plan in train_step.plans.values():
        assert plan.state + batch == pytest.approx(train_step.argument, rel=1e-3)
    assert train_step.alias == pytest.approx(train_step.output, rel=0.02)


# One chunk of 4 rows x 128 positions over 4096 ids (a 64-wide head): a float32 logits block is 8 MiB.
LOSS_ROWS, LOSS_SEQ, LOSS_VOCAB, LOSS_EMBED = 4, 128, 4096, 64


def _loss_temp_in_blocks(device, loss, dtype: str, *extra, positions: int = LOSS_SEQ) -> float:
    """XLA's GPU build's temporary bytes of grad(loss) over (hidden [rows, positions, embed], head), compiled alone, in
    float32 [rows, LOSS_SEQ, vocab] blocks: the loss's own working set (the head's gradient is the output)."""
    one = SingleDeviceSharding(device)
    hidden = jax.ShapeDtypeStruct((LOSS_ROWS, positions, LOSS_EMBED), dtype, sharding=one)
    head = jax.ShapeDtypeStruct((LOSS_EMBED, LOSS_VOCAB), jnp.float32, sharding=one)
    extra = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one) for x in extra]
    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    temp = grad.lower(hidden, head, *extra).compile().memory_analysis().temp_size_in_bytes
    return temp / (LOSS_ROWS * LOSS_SEQ * LOSS_VOCAB * 4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("teacher", [False, True], ids=["ce", "teacher"])
def test_head_loss_blocks_are_what_its_compiled_gradient_holds(h100s, dtype, teacher):
    """The planner's blocks of the training loss (`activations.head_loss_blocks`: the logits, their gradient
    in the compute dtype, a teacher's logits) against XLA's GPU build of `head_loss_sums`' gradient alone."""
    def loss(hidden, head, teacher_hidden):
        labels = jnp.zeros(hidden.shape[:2], jnp.int32)
        sums = head_loss_sums(hidden, head.astype(hidden.dtype), labels, jnp.ones(hidden.shape[:2]), chunk=512,
                              teacher=teacher_hidden if teacher else None)
        return sums.sum(), None

    teacher_hidden = jax.ShapeDtypeStruct((LOSS_ROWS, LOSS_SEQ, LOSS_EMBED), dtype)
    blocks = act.head_loss_blocks(2 if dtype == "bfloat16" else 4, teacher)
    assert _loss_temp_in_blocks(h100s[0], loss, dtype, teacher_hidden) == pytest.approx(blocks, abs=0.1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("entropy", [False, True], ids=["pg", "entropy"])
def test_rl_loss_blocks_are_what_its_compiled_gradient_holds(h100s, dtype, entropy):
    """The planner's blocks of the RL step's token statistics (`activations.rl_loss_blocks`) against XLA's
    build of `_token_stats`' gradient alone, with and without an entropy bonus."""
    class Head:
        def __init__(self, w):
            self.w = w

        def head(self, dt):
            return self.w.astype(dt)

    def loss(hidden, head, tokens):
        logp, ent = _token_stats(Head(head), hidden, tokens, 512)
        return logp.sum() + (ent.sum() if entropy else 0.0), jax.lax.stop_gradient(ent.sum())

    tokens = jax.ShapeDtypeStruct((LOSS_ROWS, LOSS_SEQ + 1), jnp.int32)   # LOSS_SEQ predicted positions
    blocks = _loss_temp_in_blocks(h100s[0], loss, dtype, tokens, positions=LOSS_SEQ + 1)
    assert blocks == pytest.approx(act.rl_loss_blocks(entropy), abs=0.1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_self_distillation_blocks_are_what_its_compiled_gradient_holds(h100s, dtype):
    """The planner's blocks of the feedback windows' self-distillation (`activations.SD_LOSS_BLOCKS`)
    against XLA's GPU build of the divergence's gradient alone (the RL step's default forward KL over the
    teacher's stop-gradient logits) on 4 windows of 128 tokens."""
    def loss(student, head, teacher, tokens):
        divergence, = chunked(lambda head_s, head_t, hs, ht, y: (rl_losses.distill_divergence(
            head_logits(head_s, hs), head_logits(head_t, ht), y, "forward_kl"),),
            512, student, teacher, tokens, heads=(head.astype(dtype), jax.lax.stop_gradient(head).astype(dtype)))
        return divergence.sum(), None

    teacher = jax.ShapeDtypeStruct((LOSS_ROWS, LOSS_SEQ, LOSS_EMBED), dtype)
    tokens = jax.ShapeDtypeStruct((LOSS_ROWS, LOSS_SEQ), jnp.int32)
    blocks = _loss_temp_in_blocks(h100s[0], loss, dtype, teacher, tokens)
    assert blocks == pytest.approx(act.SD_LOSS_BLOCKS, abs=0.15)


@pytest.fixture(scope="module")
def engine_programs(h100s):
    """The engine's prefill (16-token chunks) and decode (4 steps a call) for 16 slots of 64 positions."""
    return gpu_compile.compile_engine(_config(), h100s, slots=16, max_len=64, chunk=16, steps=4)


@pytest.mark.slow
def test_engine_prefill_and_decode_update_their_cache_in_place(engine_programs):
    """Both programs donate the latent cache and XLA aliases it to their output: per device, layers x
    slots x positions x (kv_lora 32 + rope 8) x 2 bytes with the 16 slots split over the 16 devices'
    data axes; the expert exchange is ep_ragged's, over the expert grid's ep only."""
    cache = 2 * 16 * 64 * (32 + 8) * 2 // 16
    for program in engine_programs:
        assert program.alias == cache, program.name
        exchanges = {span for kind, span in program.summary.collectives
                     if kind in ("all-to-all", "ragged-all-to-all", "collective-permute")}
        assert exchanges == {"expert:ep"} and program.summary.total("ragged-all-to-all").count > 0, program.name


def test_gpu_builds_scan_their_layer_stacks(h100s):
    """`model.layer_loop: auto` reads the platform from the traced program's mesh: a deviceless build for
    GPUs (in a process whose own backend is the CPU) scans its stacks, as GPU runs do."""
    import jax

    from composer_jax.model import decoder
    from composer_jax.train.loop import make_mesh

    dual = make_mesh(_config(), h100s)
    assert jax.default_backend() == "cpu"
    with jax.sharding.use_abstract_mesh(dual.dense.abstract_mesh):
        assert decoder.platform() == "gpu" and not decoder.unrolls("auto", 3, "none")
    assert decoder.unrolls("auto", 3, "none")      # no mesh: the process's CPU
