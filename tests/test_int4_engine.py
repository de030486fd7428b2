"""An INT4 policy's engine (`model.moe.expert_quant=int4`) holds its routed experts as Kimi K2.5 stores
them: packed nibbles and bfloat16 scales, equal bit for bit to `checkpoint.quant.quantize_int4` (checked
against compressed-tensors in tests/test_qat.py) of the learner's float weights, whether they come with
the model or arrive as a new weight version; every other parameter is the learner's, bit for bit. It
decodes what the plain engine decodes on the experts' checkpoint round trip (the INT4 policy), on one
device (experts stacked, or per-expert arrays) and on the dual grid. transformers' greedy decoding of
the dequantized checkpoint is checked in tests/test_generate_hf.py."""

from types import SimpleNamespace

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from composer_jax import CausalLM, load_config
from composer_jax.checkpoint.quant import quantize_int4
from composer_jax.config import MeshConfig
from composer_jax.infer import Engine, SamplingParams
from composer_jax.infer.engine import GenerationError
from composer_jax.infer.generate import engine_grids
from composer_jax.model import dispatch
from composer_jax.model.moe import routed_expert_paths
from composer_jax.model.quant import Int4Matrix
from composer_jax.parallel import DualMesh, record_layout, shard_model
from composer_jax.rl.engines import offered_weights
from composer_jax.rl.exchange.transport_files import FileWeightClient, FileWeightServer
from tests.random_models import random_model
from tests.test_qat import GROUP, _int4_roundtrip, _replace_experts
from tests.test_rl_remote import _config as _remote_config

SHAPES = dict(max_len=64, chunk_sizes=(8, 32), steps_per_call=4)


def _reference_int4(stack: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [..., in, out] -> the reference quantizer's (packed, scale), each [out, in] matrix's output
    transposed to the engine's [in, out] layout."""
    flat = stack.reshape(-1, *stack.shape[-2:]).astype(np.float32)
    packed, scale = zip(*(quantize_int4(m.T, GROUP) for m in flat))
    return (np.stack([p.T for p in packed]).reshape(*stack.shape[:-2], -1, stack.shape[-1]),
            np.stack([s.T for s in scale]).reshape(*stack.shape[:-2], -1, stack.shape[-1]))


def _assert_holds_int4_of(engine: Engine, model) -> None:
    learner = dict(nnx.to_flat_state(nnx.state(model)))
    routed = routed_expert_paths(model)
    assert len(routed) == 6     # three matrices of the MoE stack and of the MTP depth
    for path, var in nnx.to_flat_state(engine.state):
        value, want = var.get_value(), np.asarray(learner[path].get_value())
        if path in routed:
            assert isinstance(value, Int4Matrix), path
            packed, scale = _reference_int4(want)
            np.testing.assert_array_equal(np.asarray(value.packed), packed, err_msg=str(path))
            np.testing.assert_array_equal(np.asarray(value.scale).view(np.uint16), scale.view(np.uint16),
                                          err_msg=str(path))
            # 4 bits a weight plus a bfloat16 scale a group: 4.5 bits where float32 took 32
            assert value.nbytes * 64 == want.nbytes * 9
        else:
            np.testing.assert_array_equal(np.asarray(value), want, err_msg=str(path))


def _generate(engine: Engine) -> list:
    rng = np.random.default_rng(8)
    ids = [engine.submit(rng.integers(0, 256, n).tolist(), max_new_tokens=k, stop_tokens=[],
                         sampling=SamplingParams(0.8, 0.95, 0, seed=s))
           for s, (n, k) in enumerate([(5, 7), (12, 9), (30, 6)])]
    done = engine.run()
    return [done[i] for i in ids]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["one-device", "per-expert", "dual-grid"])
def test_int4_engine_holds_the_reference_quantizers_output_and_decodes_the_int4_policy(layout, monkeypatch):
    if layout == "per-expert":      # the tiny experts split into per-expert arrays, as large ones are
        monkeypatch.setattr(dispatch, "SMALL_EXPERT_BYTES", 0)
    grid = ["moe.dispatch=ep_a2a"] if layout == "dual-grid" else []
    cfg, plain = load_config("tiny", ["moe.expert_quant=int4", *grid]), load_config("tiny", grid)
    dual = DualMesh(MeshConfig(), model=cfg) if layout == "dual-grid" else None
    model = random_model(cfg, 3, mesh=dual)
    engine = Engine(model, max_slots=4, **SHAPES)
    _assert_holds_int4_of(engine, model)
    if layout == "per-expert":
        layer = engine._program_state["moe_layers"]["mlp"]["gate_proj"].get_value()[0]
        assert isinstance(layer, tuple) and isinstance(layer[0], Int4Matrix)

    reference = random_model(plain, 3, mesh=dual)      # the plain model on the experts' round trip
    _replace_experts(reference, _int4_roundtrip)
    want = _generate(Engine(reference, max_slots=4, **SHAPES))
    got = _generate(engine)
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-6, atol=1e-6)

    # A new version arrives in the model's layout (float experts) and is quantized on the way.
    update = random_model(cfg, 4, mesh=dual)
    engine.update_weights(engine.place_weights(nnx.state(update)), version=1)
    _assert_holds_int4_of(engine, update)
    assert jax.tree.structure(engine._model_like) == jax.tree.structure(nnx.state(update))


def test_int4_engine_names_the_parameter_a_version_gets_wrong():
    cfg = load_config("tiny", ["moe.expert_quant=int4"])
    engine = Engine(random_model(cfg, 3), max_slots=2, **SHAPES)
    wrong = load_config("tiny", ["moe.expert_quant=int4", "moe.moe_intermediate_size=64"])
    with pytest.raises(GenerationError, match="'moe_layers/mlp/down_proj' is float32\\[3, 16, 64, 64\\]"):
        engine.place_weights(nnx.state(random_model(wrong, 3)))


def test_an_int4_version_moves_through_the_exchange_as_int4(tmp_path):
    """rollout.weights=int4 with engine processes: the learner (8 devices, fsdp and ep) quantizes the routed
    experts on its own shards (`offered_weights`) and writes the version; an engine process's INT4 engine
    (2 devices, a layout of its own) reads it into the words and scales it holds: the reference quantizer's
    output of the learner's float weights, bit for bit; the version's files hold no float expert."""
    cfg = _remote_config(tmp_path, "rollout.weights=int4")
    learner = shard_model(random_model(cfg.model, 3), DualMesh(MeshConfig(), model=cfg.model))
    server = FileWeightServer(tmp_path)
    server.offer(offered_weights(cfg, SimpleNamespace(policy=lambda: learner)), 0)
    server.close()
    model = cfg.engine_model()
    engine = Engine(shard_model(random_model(model, 0), engine_grids(model, jax.devices()[:2])), max_slots=2, **SHAPES)
    engine.update_weights(FileWeightClient(tmp_path, engine.state).pull(0), version=1)
    _assert_holds_int4_of(engine, learner)
    version, = (tmp_path / "weights").glob("*.weights")
    stored = ocp.StandardCheckpointer().metadata(version.absolute()).item_metadata
    for path in routed_expert_paths(learner):
        name = ".".join(path) + ".value"
        assert name not in stored and {f"{name}.packed", f"{name}.scale"} <= set(stored), name


def test_an_engine_over_an_abstract_model_holds_nothing_until_a_version_arrives():
    """What `composer-jax rl-engine` builds: an engine over `nnx.eval_shape` of an INT4 model on the dual grid
    holds no array (ShapeDtypeStructs, placed as the engine over the real model places its arrays) and
    refuses to decode; a version in the model's layout installs the reference quantizer's words, and it
    decodes as that engine does; after `release_weights` it holds nothing again."""
    cfg = load_config("tiny", ["moe.expert_quant=int4", "moe.dispatch=ep_a2a"])
    dual = DualMesh(MeshConfig(), model=cfg)
    engine = Engine(record_layout(nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))), dual), max_slots=4,
                    **SHAPES)
    assert not engine.holds_weights and all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(engine.state))
    engine.submit([1, 2, 3], max_new_tokens=2)
    with pytest.raises(GenerationError, match="holds no weights"):
        engine.step()
    engine.queue.clear()
    model = random_model(cfg, 3, mesh=dual)
    placed = Engine(model, max_slots=4, **SHAPES)
    describe = lambda like: jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), like)  # noqa: E731
    assert describe(engine.held_like) == describe(placed.held_like)
    engine.update_weights(nnx.state(model), version=1)
    _assert_holds_int4_of(engine, model)
    for got, want in zip(_generate(engine), _generate(placed)):
        assert got.tokens == want.tokens
    engine.release_weights()
    assert not engine.holds_weights and describe(engine.held_like) == describe(placed.held_like)
