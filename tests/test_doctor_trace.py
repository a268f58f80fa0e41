"""Reading Kineto traces: typed events, links between them, and clear errors for what is not a trace."""

import gzip
import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import doctor_traces as dt
from fuselab.doctor import analyze_trace
from fuselab.doctor.trace import load_trace


def test_gzipped_and_plain_traces_read_the_same(tmp_path):
    plain = load_trace(dt.sync_bound().write(tmp_path / "t.json"))
    gz = load_trace(dt.sync_bound().write(tmp_path / "t.json.gz"))
    assert len(plain.gpu) == len(gz.gpu) == 60  # 3 steps x 10 x (mm kernel + copy)
    assert len(plain.runtime) == len(gz.runtime) == 90
    assert [s.name for s in gz.steps] == ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]


def test_events_are_typed_and_linked(tmp_path):
    trace = load_trace(dt.sync_bound(steps=1).write(tmp_path / "t.json"))
    copy = next(g for g in trace.gpu if g.kind == "memcpy")
    assert copy.device_to_host and copy.stream == dt.STREAM
    op = trace.op_for(copy.external_id)
    assert op.name == "aten::_local_scalar_dense"
    assert [o.name for o in trace.ops_enclosing(dt.TID, op.ts + 1)] == ["aten::_local_scalar_dense", "aten::item"]
    frames = trace.frames_enclosing(dt.TID, op.ts + 1)
    assert [f.name for f in frames][1:] == ["train.py(42): loop", "train.py(50): <module>"]
    mm = trace.op_for(trace.gpu[0].external_id)
    assert mm.input_dims == [[256, 256], [256, 256]] and mm.input_types == ["c10::BFloat16"] * 2
    assert trace.flows[trace.gpu[0].correlation] == (dt.BASE + 1, dt.BASE + 5)


def test_correlation_recovered_from_flow_events(tmp_path):
    doc = dt.memory_bound(steps=1).document()
    for e in doc["traceEvents"]:
        if e.get("cat") == "kernel":
            del e["args"]["correlation"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    trace = load_trace(path)
    assert [g.correlation for g in trace.gpu] == [1, 2, 3, 4]


@pytest.mark.parametrize("content, message", [
    (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1', "truncated"),
    (b"this is not json", "not valid JSON"),
    (b'{"schemaVersion": 1}', "traceEvents"),
    (b'{"traceEvents": [{"ph": "X", "cat": "blink", "name": "paint", "ts": 1, "dur": 2}]}', "not one written by torch.profiler"),
    (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": "soon"}]}', "traceEvents[0]"),
    (b'{"traceEvents": [3]}', "traceEvents[0] is a int"),
    (gzip.compress(b'{"traceEvents": []}')[:-12], "gzip"),
])
def test_bad_files_are_named_clearly(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_trace(path)


def test_missing_file_and_wrong_argument_type():
    with pytest.raises(ValueError, match="path: no trace file"):
        load_trace("/nonexistent/trace.json")
    with pytest.raises(TypeError, match="path must be"):
        load_trace(42)


def test_trace_without_gpu_events_says_so(tmp_path):
    with pytest.raises(ValueError, match="no GPU events"):
        analyze_trace(dt.cpu_only().write(tmp_path / "cpu.json"))


def test_a_real_cpu_only_trace_from_torch_profiler_says_so(tmp_path):
    x = torch.randn(8, 8)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        (x @ x).sum().item()
    path = tmp_path / "real.json"
    prof.export_chrome_trace(str(path))
    trace = load_trace(path)
    mm = next(op for op in trace.cpu_ops if op.name == "aten::mm")
    assert mm.input_dims == [[8, 8], [8, 8]] and mm.input_types == ["float", "float"]
    with pytest.raises(ValueError, match="no GPU events"):
        analyze_trace(path)
