"""A run's data on device: the repeating train split and the fixed held-out batches.

Each process feeds its own rows, sharded over the dense mesh's data-parallel axes; the step gathers the
(small, int32) batch whole before the model places tokens on the dense grid itself.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from composer_jax.data.errors import DataError
from composer_jax.data.pipeline import build_dataset
from composer_jax.data.sources import SkipLog
from composer_jax.data.chat import ChatFormat
from composer_jax.data.tokenizer import Tokenizer
from composer_jax.parallel import DualMesh
from composer_jax.parallel.mesh import BATCH_AXES
from composer_jax.train.config import RunConfig


class Batches:
    """Train batches int32[grad_accum, micro_batch, seq] and held-out batches [batch, seq], on device."""

    def __init__(self, cfg: RunConfig, dual: DualMesh, tokenizer: Tokenizer, fmt: ChatFormat):
        self.cfg = cfg
        tc = cfg.train
        self.train_sharding = NamedSharding(dual.dense, P(None, BATCH_AXES))
        self.eval_sharding = NamedSharding(dual.dense, P(BATCH_AXES))
        self.tokenizer = tokenizer
        self.skips = SkipLog()
        per_process = dict(shard_index=jax.process_index(), shard_count=jax.process_count(),
                           batch_size=tc.batch_size // jax.process_count(), seq_len=tc.seq_len, fmt=fmt)
        self.train_data = build_dataset(cfg.data, self.tokenizer, split="train", repeat=True, skips=self.skips,
                                        **per_process)
        self.eval_data = None
        if cfg.data.eval_fraction > 0:
            self.eval_data = build_dataset(cfg.data, self.tokenizer, split="eval", repeat=False,
                                           skips=SkipLog(muted=True), **per_process)
        self.iterator = iter(self.train_data)
        self._eval_batches = None

    @staticmethod
    def on_device(batch: dict, sharding, shape) -> dict:
        """Host rows (this process's share) as global arrays of `shape` laid out by `sharding`."""
        return {k: jax.make_array_from_process_local_data(sharding, v.reshape(shape)) for k, v in batch.items()}

    def next(self) -> dict:
        """The next train batch as int32[grad_accum, micro_batch, seq] arrays sharded over the data axes."""
        accum, seq = self.cfg.train.grad_accum, self.cfg.train.seq_len
        return self.on_device(next(self.iterator), self.train_sharding, (accum, -1, seq))

    def eval_batches(self) -> list[dict]:
        """The first `eval_batches` held-out batches (the same ones every time), on device."""
        if self._eval_batches is None:
            batches = []
            for batch in self.eval_data:
                batches.append(self.on_device(batch, self.eval_sharding, batch["tokens"].shape))
                if len(batches) == self.cfg.train.eval_batches:
                    break
            if not batches:
                raise DataError(f"the held-out split of {self.cfg.data.path} yields no full batch of "
                                f"{self.cfg.train.batch_size} x {self.cfg.train.seq_len} tokens; raise "
                                "data.eval_fraction or lower train.batch_size")
            self._eval_batches = batches
        return self._eval_batches

    def state(self) -> dict:
        """The train iterator's state (saved with checkpoints)."""
        return self.iterator.get_state()

    def restore(self, state: dict) -> None:
        self.iterator.set_state(state)
