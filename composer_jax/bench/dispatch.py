"""MoE dispatch backends against `dense` (every expert on every token, the reference): one layer's
forward + backward on a DualMesh over the local devices, timed side by side, each output checked
against dense. `ep_ragged` joins off CPU (XLA:CPU lacks `ragged_all_to_all`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.bench.timing import interleaved, medians
from composer_jax.config import MeshConfig
from composer_jax.model.dispatch import ExpertWeights
from composer_jax.model.expert_parallel import sharded_dispatch
from composer_jax.parallel import DualMesh
from composer_jax.parallel.mesh import DENSE_TOKEN_AXES

CPU_SKIPS = {"ep_ragged": "XLA:CPU lacks ragged_all_to_all"}


def backends() -> tuple[list[str], dict[str, str]]:
    """(backends that run here, {backend: why not} for the others)."""
    kinds = ["dense", "ragged", "ep_a2a", "ep_ragged"]
    skipped = CPU_SKIPS if jax.default_backend() == "cpu" else {}
    return [k for k in kinds if k not in skipped], dict(skipped)


def dispatch_step(kind: str, dual: DualMesh):
    """The timed program: one layer's forward + backward by backend `kind`,
    (x [tokens, embed], ExpertWeights, weights [tokens, k], idx [tokens, k]) -> ((loss, y), grads)."""
    def loss(x, experts, weights, idx):
        y, _, _ = sharded_dispatch(kind, dual, x, weights, idx, experts, 0.0)
        return jnp.sum(y.astype(jnp.float32) ** 2), y
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def dispatch_inputs(dual: DualMesh, tokens: int, embed: int, moe_mlp: int, experts: int, k: int, dtype, rng=None):
    """(x, ExpertWeights, weights, idx) placed as the section places them: random from `rng`, or
    ShapeDtypeStructs when `rng` is None."""
    tok = NamedSharding(dual.dense, P(DENSE_TOKEN_AXES, None))
    exp = NamedSharding(dual.expert, P("ep"))

    def put(make, shape, sharding, kind=dtype):
        if rng is None:
            return jax.ShapeDtypeStruct(shape, kind, sharding=sharding)
        return jax.device_put(make(shape), sharding).astype(kind)

    x = put(lambda s: rng.normal(size=s).astype(np.float32), (tokens, embed), tok)
    idx = put(lambda s: np.argsort(rng.random((s[0], experts)), axis=1)[:, :k].astype(np.int32), (tokens, k), tok,
              jnp.int32)
    weights = put(lambda s: rng.uniform(size=s).astype(np.float32), (tokens, k), tok, jnp.float32)
    expert_weights = ExpertWeights(*(put(lambda s: (0.02 * rng.normal(size=s)).astype(np.float32), shape, exp)
                                     for shape in ((experts, embed, moe_mlp), (experts, embed, moe_mlp),
                                                   (experts, moe_mlp, embed))))
    return x, expert_weights, weights, idx


def dispatch_shapes(tokens: int, embed: int, moe_mlp: int, experts: int, k: int, dtype=jnp.bfloat16) -> None:
    """Trace (shapes only) every backend's program `dispatch_section` times at these sizes."""
    dual = DualMesh(MeshConfig(fsdp=-1, ep=-1))
    args = dispatch_inputs(dual, tokens, embed, moe_mlp, experts, k, dtype)
    with dual:
        for kind in backends()[0]:
            jax.eval_shape(dispatch_step(kind, dual), *args)


def dispatch_section(tokens: int, embed: int, moe_mlp: int, experts: int, k: int, repeats: int,
                     dtype=jnp.bfloat16) -> dict:
    """Median ms per backend, the ratio to dense, and the relative error of each output against dense
    (dropless: capacity factor 0)."""
    dual = DualMesh(MeshConfig(fsdp=-1, ep=-1))
    args = dispatch_inputs(dual, tokens, embed, moe_mlp, experts, k, dtype, np.random.default_rng(0))

    def make(kind):
        fn = dispatch_step(kind, dual)

        def call():
            with dual:
                return fn(*args)
        return call

    kinds, skipped = backends()
    calls = {kind: make(kind) for kind in kinds}
    outputs = {kind: np.asarray(calls[kind]()[0][1], np.float32) for kind in kinds}
    errors = {kind: float(np.linalg.norm(outputs[kind] - outputs["dense"]) / np.linalg.norm(outputs["dense"]))
              for kind in kinds}
    ms = {kind: 1e3 * s for kind, s in medians(interleaved(calls, repeats)).items()}
    return {"devices": len(jax.devices()), "dtype": jnp.dtype(dtype).name,
            "shape": {"tokens": tokens, "embed": embed, "moe_mlp": moe_mlp, "experts": experts, "k": k},
            "median_ms": ms, "over_dense": {kind: ms[kind] / ms["dense"] for kind in kinds},
            "rel_error_vs_dense": errors, "skipped": skipped}
