"""The suite's own tooling: `tools/compile_report.py` writes the per-file seconds that `tests/conftest.py`
orders the files by, and the recorded file covers the suite's longest files."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import compile_report  # noqa: E402

FIELDS = dict(cpu_s=0.0, compiles=0, compile_s=0.0, traces=0, trace_s=0.0, lower_s=0.0)


def test_file_seconds_sum_each_files_tests_longest_first(tmp_path, capsys):
    records = {"cr.gw0": [("tests/test_a.py::test_one", 2.0), ("tests/test_b.py::test_one", 30.4)],
               "cr.gw1": [("tests/test_a.py::test_two", 5.3), ("tests/test_c.py::test_one", 0.2)]}
    for name, rows in records.items():
        (tmp_path / name).write_text("".join(json.dumps({"test": t, "wall_s": w, **FIELDS}) + "\n" for t, w in rows))
    out = tmp_path / "file_seconds.json"
    paths = [str(tmp_path / "cr.gw0"), str(tmp_path / "cr.gw1")]
    assert compile_report.main([*paths, "--write-file-seconds", str(out)]) == 0
    assert list(json.loads(out.read_text()).items()) == [("tests/test_b.py", 30), ("tests/test_a.py", 7),
                                                         ("tests/test_c.py", 0)]
    assert "| tests/test_b.py |" in capsys.readouterr().out


def test_the_recorded_order_names_existing_files_and_starts_with_the_end_to_end_runs():
    recorded = json.loads((ROOT / "tests" / "file_seconds.json").read_text())
    assert all((ROOT / path).is_file() for path in recorded), [p for p in recorded if not (ROOT / p).is_file()]
    first = sorted(recorded, key=recorded.get, reverse=True)[:3]
    assert {"tests/test_recipe.py", "tests/test_coding_study.py"} <= set(first), first
