"""Weight versions through the exchange directory (`rollout.weight_transfer=file`): each version a
snapshot file `<session>/weights/<version>.npz`. Works wherever both processes see one filesystem, at the
cost of a host round trip and a write per version. The same calls as the device transport: the learner
`offer`s a version, the engine lists `versions()` and `pull`s one."""

from __future__ import annotations

from pathlib import Path

import jax

from composer_jax.rl.exchange.directory import numbered, numbered_file, prune
from composer_jax.rl.exchange.npz import read_weights, write_weights

KEEP_VERSIONS = 3           # weight versions kept in the directory (an engine may still be reading an older one)


class FileWeightServer:
    """The learner's side: `offer(state, version)` writes the snapshot (every process of a group calls it;
    process 0 writes) and removes all but the newest KEEP_VERSIONS."""

    def __init__(self, session_dir: Path):
        self.dir = session_dir / "weights"

    def offer(self, state, version: int) -> None:
        write_weights(numbered_file(self.dir, version), state, version)
        if jax.process_index() == 0:
            prune(self.dir, KEEP_VERSIONS)

    def close(self) -> None:
        pass


class FileWeightClient:
    """The engine's side: the versions in the directory, and one read into the structure of `like`."""

    def __init__(self, session_dir: Path, like):
        self.dir, self.like = session_dir / "weights", like

    def versions(self) -> list[int]:
        return numbered(self.dir)

    def pull(self, version: int):
        """The parameters at `version`; None if the learner removed the file meanwhile (a newer one is there)."""
        try:
            return read_weights(numbered_file(self.dir, version), self.like)[0]
        except FileNotFoundError:
            return None
