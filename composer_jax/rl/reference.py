"""The frozen reference policy of the KL term: its log-probs of a rollout batch's tokens, computed on the
learner's devices with parameters fixed at the start of RL (init_from's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composer_jax.model.transformer import head_logits
from composer_jax.parallel.distributed import to_host
from composer_jax.parallel.partitioning import gather_sequence
from composer_jax.rl import losses
from composer_jax.rl.batch import RolloutBatch
from composer_jax.rl.ingest import device_batch, process_rows
from composer_jax.rl.rows import chunked


class ReferencePolicy:
    """ref = ReferencePolicy(model, loss_chunk); batch = ref.annotate(batch) fills `ref_logprobs`.
    Holds a copy of the model's parameters (the learner's own arrays are donated by its steps)."""

    def __init__(self, model, loss_chunk: int):
        self.graphdef, state = nnx.split(model)
        self.state = jax.tree.map(jnp.copy, state)
        self.dual = model.mesh

        def logprobs(state, tokens, segment_ids, positions, generated):
            ref = nnx.merge(self.graphdef, state)
            hidden = gather_sequence(ref.forward(tokens, segment_ids, positions).hidden)
            logp, = chunked(lambda head, h, y: (losses.token_logprobs(head_logits(head, h), y),), loss_chunk,
                            hidden[:, :-1], tokens[:, 1:], heads=(ref.head(hidden.dtype),))
            logp = jnp.concatenate([jnp.zeros_like(logp[:, :1]), logp], axis=1)   # slot 0 has no context
            return jnp.where(generated, logp, 0.0)

        self._logprobs = jax.jit(logprobs)

    def annotate(self, batch: RolloutBatch) -> RolloutBatch:
        """`batch` (numpy; this process's rows) with ref_logprobs f32[B, S]: log pi_ref(token) on generated
        tokens, 0 elsewhere."""
        on_device = device_batch(batch, self.dual)
        logp = self._logprobs(self.state, on_device.tokens, on_device.segment_ids, on_device.positions,
                              on_device.generated)
        return batch._replace(ref_logprobs=np.asarray(process_rows(to_host(logp)), np.float32))
