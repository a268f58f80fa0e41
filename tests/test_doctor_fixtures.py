"""The doctor on real traces of labelled workloads recorded on a GPU (scripts/record-doctor-fixtures).

Each file in tests/fixtures/doctor/ is named after its workload; EXPECTED says what the analysis
must find in it. Until the fixtures are recorded, these tests are skipped.
"""

import re
from pathlib import Path

import pytest

from fuselab.device import STATED_CEILINGS
from fuselab.doctor import analyze_trace

FIXTURES = Path(__file__).parent / "fixtures" / "doctor"
RECORDER = Path(__file__).parent.parent / "scripts" / "record-doctor-fixtures"


def _recorder_constant(name: str) -> int:
    return int(re.search(rf"^{name} = (\d+)", RECORDER.read_text(), re.MULTILINE)[1])


def _function_holding(marker: str) -> int:
    """The line of the `def` enclosing the marked line: the profiler names a Python frame entered while
    it records by the line its function starts on, not by the line that is running."""
    lines = RECORDER.read_text().splitlines()
    marked = next(n for n, line in enumerate(lines, 1) if marker in line)
    return next(n for n in range(marked, 0, -1) if lines[n - 1].lstrip().startswith("def "))


EXPECTED = {
    "launch_bound": {"verdict": "launch-bound", "kernels_per_step": 3 * _recorder_constant("LAUNCH_BOUND_OPS"), "syncs_per_step": 0},
    "sync_bound": {"verdict": "sync-bound", "syncs_per_step": _recorder_constant("SYNC_BOUND_ITERATIONS"),
                   "sync_cause": "`.item()`", "sync_line": _function_holding("# doctor-fixture: the sync")},
    "memory_bound": {"verdict": "memory-bound", "kernels_per_step": 6, "syncs_per_step": 0},
    "compute_bound": {"verdict": "compute-bound", "syncs_per_step": 0},
    "llama_decode": {"verdict": "launch-bound"},
}
FILES = sorted(FIXTURES.glob("*.json.gz"))


@pytest.mark.skipif(not FILES, reason="no recorded fixtures yet (run scripts/record-doctor-fixtures on a GPU)")
@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_recorded_workload_gets_its_verdict(path):
    label = path.name.removesuffix(".json.gz")
    assert label in EXPECTED, f"{path.name}: no expectation for this fixture; add it to EXPECTED"
    want = EXPECTED[label]
    d = analyze_trace(path, ceilings=STATED_CEILINGS)
    assert d.verdict == want["verdict"], d.evidence
    assert d.steps == _recorder_constant("PROFILED_STEPS")
    for key in ("kernels_per_step", "syncs_per_step"):
        if key in want:
            assert getattr(d, key) == want[key]
    assert sum(p["share"] for p in d.breakdown.values()) == pytest.approx(1.0)
    if "sync_line" in want:
        syncs = [s for step in d.analysis.syncs for s in step]
        assert {s.cause for s in syncs} == {want["sync_cause"]}
        # The path is the recording machine's; the file name and line are what must match.
        assert all(s.source.split(" (")[0].endswith(f"{RECORDER.name}:{want['sync_line']}") for s in syncs)
