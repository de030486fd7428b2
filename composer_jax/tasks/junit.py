"""Per-test outcomes from pytest's JUnit XML report (never from its console output).

pytest names a test case `classname` = the node id's path (slashes -> dots, '.py' dropped) and classes
joined by dots, `name` = the last node id part with its parameters (`_pytest.junitxml.mangle_test_address`).
We map the node ids we care about to those keys instead of guessing paths back from dotted names.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

PASSED, FAILED, ERROR, SKIPPED, MISSING = "passed", "failed", "error", "skipped", "missing"
_SEVERITY = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3}


def junit_key(node_id: str) -> tuple[str, str]:
    """'tests/test_a.py::TestX::test_y[1]' -> ('tests.test_a.TestX', 'test_y[1]'), as pytest writes it."""
    path, bracket, params = node_id.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def read_report(path: Path, messages: dict[tuple[str, str], str] | None = None
                ) -> dict[tuple[str, str], str] | None:
    """{(classname, name): outcome} from a JUnit XML file; None if it is missing or unreadable.
    A test case reported twice (e.g. a teardown error after a pass) keeps its worst outcome.
    `messages`: filled with {(classname, name): message} of the failures and errors (pytest's one-line
    summary of the exception, e.g. "AssertionError: assert 3 == 4")."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    outcomes: dict[tuple[str, str], str] = {}
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        outcome = ERROR if "error" in tags else FAILED if "failure" in tags else SKIPPED if "skipped" in tags \
            else PASSED
        key = (case.get("classname", ""), case.get("name", ""))
        if messages is not None and outcome in (FAILED, ERROR):
            found = next(child for child in case if child.tag in ("error", "failure"))
            messages.setdefault(key, found.get("message") or (found.text or "").strip())
        if _SEVERITY[outcome] >= _SEVERITY.get(outcomes.get(key, PASSED), 0):
            outcomes[key] = outcome
    return outcomes


def outcomes_for(node_ids, report: dict[tuple[str, str], str] | None) -> dict[str, str]:
    """{node id: outcome}; a test absent from the report (not collected, deleted, renamed) is 'missing'."""
    report = report or {}
    return {n: report.get(junit_key(n), MISSING) for n in node_ids}
