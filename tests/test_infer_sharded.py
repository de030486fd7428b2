"""The engine on the 8-device dual grid (dense fsdp=8, experts ep=8 through `ep_a2a`) under the
inference placement gives the single-device tokens, for a batch split over the devices and for a
batch of two (replicated; the expert dispatch spreads its tokens), plain and speculative; its compiled
decode step gathers no weight (FSDP would gather every dense weight once per token)."""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from composer_jax import load_config
from composer_jax.config import MeshConfig
from composer_jax.infer import Engine, SamplingParams, programs
from composer_jax.infer.programs import Slots
from composer_jax.infer.sampling import SlotSampling
from composer_jax.parallel import DualMesh
from tests.random_models import random_model

# The compiles here take longer than ~30 s on 2 cores in all.
pytestmark = pytest.mark.slow

SHAPES = dict(max_len=64, chunk_sizes=(8, 32), steps_per_call=4)


@pytest.fixture(scope="module")
def models():
    """(single-device model, the same weights on the dual grid)."""
    cfg = load_config("tiny", ["moe.dispatch=ep_a2a"])
    dual = DualMesh(MeshConfig(), model=cfg)
    return random_model(load_config("tiny"), 3), random_model(cfg, 3, mesh=dual), dual


def _requests():
    rng = np.random.default_rng(8)
    return [dict(prompt=rng.integers(0, 256, n).tolist(), max_new_tokens=k, stop_tokens=[],
                 sampling=SamplingParams(0.8, 0.95, 0, seed=s))
            for s, (n, k) in enumerate([(5, 7), (12, 9), (30, 6)])]


def _generate(engine, requests):
    ids = [engine.submit(**r) for r in requests]
    done = engine.run()
    return [done[i] for i in ids]


@pytest.mark.parametrize("slots,speculative", [(8, True), (2, False)])
def test_sharded_engine_equals_one_device(models, slots, speculative):
    single, sharded, dual = models
    drafts = dict(speculative=speculative, draft_tokens=1)    # one draft: the verify pass's layout at its cheapest
    want = _generate(Engine(single, max_slots=slots, **drafts, **SHAPES), _requests())
    engine = Engine(sharded, max_slots=slots, **drafts, **SHAPES)  # sets its own context mesh
    got = _generate(engine, _requests())
    assert engine.dual.inference and engine.dual.dense == dual.dense
    spec = jax.tree.leaves(engine.cache.main)[0].sharding.spec
    assert spec[1] == (("replica", "fsdp") if slots == 8 else None)   # slots split where they divide
    for g, w in zip(got, want):
        assert g.tokens == w.tokens
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)

    if slots == 8:  # the compiled decode step (already in the jit cache): no weight is gathered
        n = slots
        state = Slots(*(np.zeros(n, np.int32) for _ in range(2)), np.ones(n, bool), np.ones(n, np.int32),
                      np.full((n, 8), -1, np.int32), SlotSampling.of([SamplingParams()] * n))
        with dual:
            hlo = engine.programs.decode.lower(engine.graphdef, engine.state, engine.cache, engine._put(state),
                                        SHAPES["steps_per_call"], SHAPES["max_len"]).compile().as_text()
        gathered = {tuple(int(d) for d in dims.split(",") if d)
                    for dims in re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather\(", hlo)}
        weights = set()
        for x in jax.tree.leaves(nnx.state(sharded)):
            weights |= {tuple(x.shape), tuple(x.shape[1:])}       # whole, or one layer of a stack
        assert "all-to-all(" in hlo                               # the experts' exchange
        assert gathered and not gathered & weights, sorted(gathered & weights)
