"""MoE dispatch timings on the local accelerator: every backend on one K2.5-shaped layer slice.

    python tools/gpu_timings.py --json PATH

Runs `dense` (the reference), `ragged`, `ep_a2a` and `ep_ragged` forward + backward in bf16 on a
DualMesh over all local devices, checks each against `dense`, and prints median milliseconds and the
ratio to `ragged`, measured side by side (interleaved repeats) in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.config import MeshConfig
from composer_jax.model.dispatch import ExpertWeights
from composer_jax.model.expert_parallel import sharded_dispatch
from composer_jax.parallel import DualMesh
from composer_jax.parallel.mesh import DENSE_TOKEN_AXES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--embed", type=int, default=2048)
    parser.add_argument("--moe-mlp", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    dual = DualMesh(MeshConfig(fsdp=-1, ep=-1))
    rng = np.random.default_rng(0)
    t, d, f, e, k = args.tokens, args.embed, args.moe_mlp, args.experts, args.k
    tok = NamedSharding(dual.dense, P(DENSE_TOKEN_AXES, None))
    x = jax.device_put(rng.normal(size=(t, d)).astype(np.float32), tok).astype(jnp.bfloat16)
    idx = jax.device_put(np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32), tok)
    weights = jax.device_put(rng.uniform(size=(t, k)).astype(np.float32), tok)
    experts = ExpertWeights(*(jax.device_put((0.02 * rng.normal(size=s)).astype(np.float32),
                                             NamedSharding(dual.expert, P("ep"))).astype(jnp.bfloat16)
                              for s in ((e, d, f), (e, d, f), (e, f, d))))

    def make(kind):
        def loss(x, experts):
            y, _, _ = sharded_dispatch(kind, dual, x, weights, idx, experts, 0.0)
            return jnp.sum(y.astype(jnp.float32) ** 2), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

    kinds = ["dense", "ragged", "ep_a2a", "ep_ragged"]
    with dual:
        fns = {kind: make(kind) for kind in kinds}
        outs = {kind: jax.block_until_ready(fns[kind](x, experts)) for kind in kinds}  # compile + warm up
        ref = np.asarray(outs["dense"][0][1], np.float32)
        errors = {kind: float(np.linalg.norm(np.asarray(outs[kind][0][1], np.float32) - ref) / np.linalg.norm(ref))
                  for kind in kinds}
        times = {kind: [] for kind in kinds}
        for _ in range(args.repeats):  # interleaved, so drift hits every backend alike
            for kind in kinds:
                start = time.perf_counter()
                jax.block_until_ready(fns[kind](x, experts))
                times[kind].append(time.perf_counter() - start)
    median = {kind: 1e3 * statistics.median(v) for kind, v in times.items()}
    result = {"devices": [str(dv) for dv in jax.devices()], "shape": vars(args), "median_ms": median,
              "ratio_to_ragged": {kind: median[kind] / median["ragged"] for kind in kinds},
              "rel_error_vs_dense": errors}
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=2)
    for kind in kinds:
        print(f"{kind:10s} {median[kind]:8.2f} ms  x{result['ratio_to_ragged'][kind]:.2f} of ragged  "
              f"rel.err {errors[kind]:.1e}")
    bad = [kind for kind in kinds if not errors[kind] < 2e-2]
    print("all backends agree with dense (bf16)" if not bad else f"MISMATCH: {bad}")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
