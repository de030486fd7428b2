"""Packing variable-length examples into fixed-length rows, with an exact, compact iterator state.

Each input example is `{"tokens": int32[n], "loss_mask": int32[n]}`; each output row is
`{"tokens", "segment_ids", "positions", "loss_mask"}`, all int32[seq_len]: segment ids 1, 2, ... per
document within the row (0 in padding), positions restarting at 0 with each segment.

- `split=True` (pretraining): documents are concatenated and cut into rows; a document that does not
  fit continues as a new segment at the start of the next row, so there is no padding (except at the
  end of a finite pass).
- `split=False` (SFT): an example never straddles rows; one that does not fit in the rest of the row
  starts the next row (next-fit), the rest is padded. Examples longer than a row must be truncated
  upstream.

The state is the parent iterator's state *before* the example in progress plus the offset into it,
so `set_state` replays exactly one example. (grain's own ConcatThenSplitIterDataset restores a wrong
position for some checkpoints in grain 0.2.18, which would break exact resumption.)
"""

from __future__ import annotations

import grain
import numpy as np


class PackIterDataset(grain.IterDataset):
    """Rows of `seq_len` tokens packed from the parent's examples (see module docstring)."""

    def __init__(self, parent: grain.IterDataset, seq_len: int, split: bool):
        super().__init__(parent)
        self.seq_len, self.split = seq_len, split

    def __iter__(self) -> "PackIterator":
        return PackIterator(self._parent.__iter__(), self.seq_len, self.split)


class PackIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, seq_len: int, split: bool):
        super().__init__(parent)
        self.seq_len, self.split = seq_len, split
        self._doc = None               # the example in progress
        self._offset = 0               # tokens of it already emitted
        self._doc_state = parent.get_state()  # parent state before `_doc` was read

    def _advance(self) -> bool:
        """Read the next example; False at the end of the parent."""
        state = self._parent.get_state()
        try:
            doc = next(self._parent)
        except StopIteration:
            return False
        if not self.split and len(doc["tokens"]) > self.seq_len:
            raise ValueError(f"an example of {len(doc['tokens'])} tokens does not fit a row of {self.seq_len}")
        self._doc, self._offset, self._doc_state = doc, 0, state
        return True

    def __next__(self) -> dict:
        n = self.seq_len
        row = {k: np.zeros((n,), np.int32) for k in ("tokens", "segment_ids", "positions", "loss_mask")}
        fill, segment = 0, 0
        while fill < n:
            if self._doc is None or self._offset >= len(self._doc["tokens"]):
                if not self._advance():
                    break
            doc, start = self._doc, self._offset
            remaining = len(doc["tokens"]) - start
            if not self.split and remaining > n - fill:
                break  # next-fit: this example starts the next row
            take = min(n - fill, remaining)
            segment += 1
            row["tokens"][fill:fill + take] = doc["tokens"][start:start + take]
            row["loss_mask"][fill:fill + take] = doc["loss_mask"][start:start + take]
            row["segment_ids"][fill:fill + take] = segment
            row["positions"][fill:fill + take] = np.arange(take)
            fill += take
            self._offset += take
        if fill == 0:
            raise StopIteration
        return row

    def get_state(self) -> dict:
        return {"parent": self._doc_state, "offset": self._offset, "in_progress": self._doc is not None}

    def set_state(self, state: dict) -> None:
        self._parent.set_state(state["parent"])
        self._doc, self._offset, self._doc_state = None, 0, state["parent"]
        if state["in_progress"]:
            self._doc = next(self._parent)
            self._offset = state["offset"]
