"""Random-access record sources for grain: local text/code trees, JSONL, Parquet and ArrayRecord.

Every source is a grain `RandomAccessDataSource` (`__len__`, `__getitem__`) whose records are plain
dicts: `{"text": ...}` for a text tree, the JSON object of a JSONL line or an ArrayRecord record, the
row of a Parquet file. A record that cannot be used (binary or unreadable file, malformed JSON, a file
over the size limit) comes back as `None`, which grain drops; `SkipLog` counts it by reason and lists
it (path relative to the data root) in the run's skip file. Paths that cannot be used at all (missing,
unreadable, matching no files) are a `DataError` naming the path.

`split_indices` gives a deterministic held-out split keyed by a stable hash of each record's key (the
relative file path for trees, the record index otherwise), independent of machine and Python hashing.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import json
import sysconfig
import threading
from pathlib import Path

import numpy as np

from composer_jax.data.errors import DataError


STDLIB = "stdlib"  # the special data path: this Python's standard library sources
DEFAULT_GLOBS = {"text_tree": "**/*", "python_functions": "**/*.py", "jsonl": "**/*.jsonl",
                 "parquet": "**/*.parquet", "array_record": "**/*.array_record*"}
BINARY_SNIFF_BYTES = 8192
HELD_LINES = 10_000  # skip lines kept in memory until the skip file is set (a run sets it as it starts)


class SkipLog:
    """Thread-safe counts of skipped records by reason, and of records kept truncated; nothing goes to
    the console (the run prints a summary). Each one is a line of the file set by `write_to` (the run's
    `skipped_records.log`), in full; lines from before it is set (up to HELD_LINES) are held and written
then. `muted`
    (for probing reads) counts without writing."""

    def __init__(self, muted: bool = False):
        self._lock = threading.Lock()
        self.counts: collections.Counter = collections.Counter()
        self.truncated = 0
        self.muted = muted
        self._file, self._held = None, []

    def _record(self, line: str) -> None:
        if self.muted:
            return
        if self._file is None:
            if len(self._held) < HELD_LINES:
                self._held.append(line)
        else:
            self._file.write(line)

    def skip(self, reason: str, culprit: str) -> None:
        """Count a record that is left out (returns None: sources return it for a dropped record)."""
        with self._lock:
            self.counts[reason] += 1
            self._record(f"skipped ({reason}): {culprit}\n")

    def keep_truncated(self, culprit: str) -> None:
        """Count a record that is kept but cut to the row length."""
        with self._lock:
            self.truncated += 1
            self._record(f"truncated: {culprit}\n")

    def write_to(self, path: Path, header: str) -> None:
        """From now on append every line to `path` (a `# header` line first), held lines included."""
        with self._lock:
            self._file = open(path, "a", buffering=1)
            self._file.write(f"# {header}\n" + "".join(self._held))
            self._held = []

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """e.g. 'skipped records: binary 2, empty 1; truncated 4' ('' when nothing happened)."""
        parts = []
        if self.counts:
            parts.append("skipped records: " + ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items())))
        if self.truncated:
            parts.append(f"truncated {self.truncated}")
        return "; ".join(parts)


def resolve_root(path: str) -> Path:
    """The data path as a Path; `stdlib` is this Python's standard library directory."""
    if path == STDLIB:
        return Path(sysconfig.get_paths()["stdlib"])
    return Path(path).expanduser()


def list_files(path: str, pattern: str, exclude: tuple[str, ...] = ()) -> tuple[Path, list[str]]:
    """(root, sorted relative paths) of the files under `path` matching `pattern`, skipping any whose
    path has a component in `exclude`. A single file is its own root. Raises DataError naming the path
    when it is missing, unreadable, or matches nothing."""
    root = resolve_root(path)
    if not root.exists():
        raise DataError(f"data path {root} does not exist")
    if root.is_file():
        return root.parent, [root.name]
    try:
        files = sorted(str(p.relative_to(root)) for p in root.glob(pattern)
                       if p.is_file() and not set(p.relative_to(root).parts) & set(exclude))
    except PermissionError as e:
        raise DataError(f"data path {root} cannot be read: {e}") from None
    if not files:
        if not any(root.iterdir()):
            raise DataError(f"data path {root} is an empty directory")
        raise DataError(f"data path {root} has no files matching {pattern!r}"
                        + (f" outside {', '.join(exclude)}" if exclude else ""))
    return root, files


def read_text_file(path: Path, max_bytes: int, skips: SkipLog, name: str | None = None) -> str | None:
    """The file's UTF-8 text, or None (counted in `skips` under `name`, default the path) if unreadable,
    binary, empty or too large."""
    name = name or str(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            return skips.skip("too_large", f"{name} ({size} bytes > data.max_file_bytes={max_bytes})")
        data = path.read_bytes()
    except OSError as e:
        return skips.skip("unreadable", f"{name} ({e.strerror or e})")
    if b"\0" in data[:BINARY_SNIFF_BYTES]:
        return skips.skip("binary", name)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return skips.skip("binary", f"{name} (not UTF-8)")
    if not text.strip():
        return skips.skip("empty", name)
    return text


class TextTreeSource:
    """One record per file of a text/code tree: {"text": contents, "path": relative path}."""

    def __init__(self, path: str, pattern: str, exclude: tuple[str, ...], max_bytes: int, skips: SkipLog):
        self.root, self.files = list_files(path, pattern, exclude)
        self.max_bytes, self.skips = max_bytes, skips

    def keys(self) -> list[str]:
        return self.files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict | None:
        rel = self.files[i]
        text = read_text_file(self.root / rel, self.max_bytes, self.skips, name=rel)
        return None if text is None else {"text": text, "path": rel}


class JsonlSource:
    """One record per non-empty line of the JSONL files (the parsed JSON object)."""

    def __init__(self, path: str, pattern: str, exclude: tuple[str, ...], skips: SkipLog):
        self.root, self.files = list_files(path, pattern, exclude)
        self.skips = skips
        self._offsets = []  # per file: int64[lines + 1] byte offsets of line starts
        for rel in self.files:
            try:
                data = np.frombuffer((self.root / rel).read_bytes(), np.uint8)
            except OSError as e:
                raise DataError(f"data file {self.root / rel} cannot be read: {e.strerror or e}") from None
            ends = np.flatnonzero(data == ord("\n")) + 1
            if len(data) and (not len(ends) or ends[-1] != len(data)):
                ends = np.append(ends, len(data))  # a last line without a newline
            self._offsets.append(np.concatenate([[0], ends]).astype(np.int64))
        self._starts = np.cumsum([0] + [len(o) - 1 for o in self._offsets]).tolist()

    def keys(self) -> range:
        return range(len(self))

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, i: int) -> dict | None:
        f = bisect.bisect_right(self._starts, i) - 1
        line_no = i - self._starts[f]
        start, end = self._offsets[f][line_no], self._offsets[f][line_no + 1]
        where = f"{self.files[f]}:{line_no + 1}"
        with open(self.root / self.files[f], "rb") as fh:
            fh.seek(start)
            raw = fh.read(end - start)
        if not raw.strip():
            return self.skips.skip("empty", where)
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return self.skips.skip("bad_json", f"{where} ({e})")
        if not isinstance(record, dict):
            return self.skips.skip("bad_record", f"{where} (a JSON {type(record).__name__}, not an object)")
        return record


class ParquetSource:
    """One record per row of the Parquet files: {column: value} for the requested columns."""

    def __init__(self, path: str, pattern: str, exclude: tuple[str, ...], columns: tuple[str, ...]):
        import pyarrow.parquet as pq

        self.root, self.files = list_files(path, pattern, exclude)
        self.columns = columns
        self._groups = []  # (file index, row group, first global row)
        total = 0
        for fi, rel in enumerate(self.files):
            try:
                meta = pq.ParquetFile(self.root / rel)
            except Exception as e:  # pyarrow raises ArrowInvalid / OSError
                raise DataError(f"data file {self.root / rel} is not a readable Parquet file: {e}") from None
            missing = [c for c in columns if c not in meta.schema_arrow.names]
            if missing:
                raise DataError(f"data file {self.root / rel} has no column {missing[0]!r} "
                                f"(columns: {', '.join(meta.schema_arrow.names)})")
            for g in range(meta.num_row_groups):
                self._groups.append((fi, g, total))
                total += meta.metadata.row_group(g).num_rows
        self._len = total
        self._firsts = [g[2] for g in self._groups]
        self._local = threading.local()  # per-thread cache of the last row group read

    def keys(self) -> range:
        return range(len(self))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict:
        import pyarrow.parquet as pq

        gi = bisect.bisect_right(self._firsts, i) - 1
        fi, g, first = self._groups[gi]
        cache = getattr(self._local, "cache", None)
        if cache is None or cache[0] != gi:
            table = pq.ParquetFile(self.root / self.files[fi]).read_row_group(g, columns=list(self.columns))
            cache = self._local.cache = (gi, {c: table.column(c).to_pylist() for c in self.columns})
        return {c: vals[i - first] for c, vals in cache[1].items()}


class ArrayRecordSource:
    """One record per ArrayRecord entry: {"text": utf-8 text}, or the JSON object when `parse_json`."""

    def __init__(self, path: str, pattern: str, exclude: tuple[str, ...], parse_json: bool, skips: SkipLog):
        import grain

        root, files = list_files(path, pattern, exclude)
        self.paths = [str(root / f) for f in files]
        try:
            self._src = grain.sources.ArrayRecordDataSource(self.paths)
        except Exception as e:
            raise DataError(f"data files under {root} are not readable ArrayRecord files: {e}") from None
        self.parse_json, self.skips = parse_json, skips

    def keys(self) -> range:
        return range(len(self))

    def __len__(self) -> int:
        return len(self._src)

    def __getitem__(self, i: int) -> dict | None:
        raw = self._src[i]
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return self.skips.skip("binary", f"ArrayRecord record {i} (not UTF-8)")
        if not self.parse_json:
            return {"text": text}
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            return self.skips.skip("bad_json", f"ArrayRecord record {i} ({e})")
        return record if isinstance(record, dict) else self.skips.skip("bad_record", f"ArrayRecord record {i}")


def _unit_interval(keys) -> np.ndarray:
    """A stable pseudo-random number in [0, 1) per key (str: blake2b; int: splitmix64)."""
    if isinstance(keys, range):
        x = np.arange(keys.start, keys.stop, keys.step, dtype=np.uint64)
        with np.errstate(over="ignore"):
            x = x + np.uint64(0x9E3779B97F4A7C15)
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            x = x ^ (x >> np.uint64(31))
        return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    digests = [int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8).digest(), "little") for k in keys]
    return (np.asarray(digests, np.uint64) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def split_indices(keys, split: str, eval_fraction: float) -> np.ndarray:
    """int64 indices of the records in `split` ('train' or 'eval'): eval holds ~eval_fraction of them."""
    u = _unit_interval(keys)
    chosen = u < eval_fraction if split == "eval" else u >= eval_fraction
    return np.flatnonzero(chosen)
