"""`--perfetto PATH`: the trace as it was, plus the doctor's steps, idle gaps and syncs as tracks."""

import gzip
import json

import doctor_traces as dt
from fuselab.cli import main
from fuselab.device import STATED_CEILINGS
from fuselab.doctor import analyze_trace
from fuselab.doctor.analyze import analyze_file
from fuselab.doctor.perfetto import CATEGORY, write_perfetto


def test_tracks_are_added_and_the_trace_kept(tmp_path):
    source = dt.sync_bound().write(tmp_path / "t.json")
    a = analyze_file(source, ceilings=STATED_CEILINGS)
    out = write_perfetto(a, tmp_path / "doctor.json")
    data = json.loads(out.read_text())
    original = json.loads(source.read_text())["traceEvents"]
    assert data["traceEvents"][:len(original)] == original
    added = [e for e in data["traceEvents"] if e.get("cat") == CATEGORY]
    names = [e["name"] for e in added]
    assert names.count("sync: `.item()`") == 30 and sum(n.startswith("ProfilerStep#") for n in names) == 3
    assert names.count("sync stall") == sum(kind == "sync" for step in a.gaps for _, _, kind in step)
    assert {e["pid"] for e in added} == {dt.PID + 1}  # a process of its own, beside the trace's
    sync = next(e for e in added if e["name"].startswith("sync:"))
    assert sync["args"]["source"] == "train.py:42 (loop)" and sync["dur"] == 19.0
    # The doctor reads its own output as the trace it was.
    reread = analyze_trace(out, ceilings=STATED_CEILINGS).to_dict()["per_step"]
    assert reread == analyze_trace(source, ceilings=STATED_CEILINGS).to_dict()["per_step"]


def test_cli_writes_gzipped_tracks(tmp_path, capsys):
    source = dt.launch_bound().write(tmp_path / "t.json.gz")
    out = tmp_path / "doctor.json.gz"
    assert main(["doctor", "--trace", str(source), "--perfetto", str(out)]) == 0
    assert f"wrote {out}" in " ".join(capsys.readouterr().out.split())
    events = json.loads(gzip.decompress(out.read_bytes()))["traceEvents"]
    assert sum(e.get("name") == "launch gap (GPU waited for the host)" for e in events) == 3 * 99
