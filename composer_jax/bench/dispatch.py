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


def dispatch_section(tokens: int, embed: int, moe_mlp: int, experts: int, k: int, repeats: int,
                     dtype=jnp.bfloat16) -> dict:
    """Median ms per backend, the ratio to dense, and the relative error of each output against dense
    (dropless: capacity factor 0)."""
    dual = DualMesh(MeshConfig(fsdp=-1, ep=-1))
    rng = np.random.default_rng(0)
    tok = NamedSharding(dual.dense, P(DENSE_TOKEN_AXES, None))
    x = jax.device_put(rng.normal(size=(tokens, embed)).astype(np.float32), tok).astype(dtype)
    idx = jax.device_put(np.argsort(rng.random((tokens, experts)), axis=1)[:, :k].astype(np.int32), tok)
    weights = jax.device_put(rng.uniform(size=(tokens, k)).astype(np.float32), tok)
    expert_weights = ExpertWeights(*(
        jax.device_put((0.02 * rng.normal(size=shape)).astype(np.float32),
                       NamedSharding(dual.expert, P("ep"))).astype(dtype)
        for shape in ((experts, embed, moe_mlp), (experts, embed, moe_mlp), (experts, moe_mlp, embed))))

    def make(kind):
        def loss(x, experts):
            y, _, _ = sharded_dispatch(kind, dual, x, weights, idx, experts, 0.0)
            return jnp.sum(y.astype(jnp.float32) ** 2), y
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

        def call():
            with dual:
                return fn(x, expert_weights)
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
