"""Tensor parallelism on the CPU: two gloo ranks serve tiny checkpoints with the tokens of one
process and of transformers; bad sizes are refused; a rank that fails, dies or hangs fails the
call within seconds, naming the rank, and leaves no process behind."""

from __future__ import annotations

import gc
import multiprocessing
import os
import random
import subprocess
import sys
import time

import pytest
import torch

from engine_checkpoints import build_hf_model, hf_greedy, save_checkpoint
from fuselab.cli import main
from fuselab.engine import LLM, SamplingParams
from fuselab.engine.workers import TensorParallelError, WorkerGroup

ENGINE = dict(mode="eager", dtype="float32", max_model_len=128)


@pytest.fixture(scope="module")
def single(checkpoint):
    return LLM(checkpoint, **ENGINE, max_num_seqs=1)


@pytest.fixture(scope="module")
def tp(checkpoint):
    # A cache of 24 blocks (3 sequences of max_model_len): the load tests below preempt.
    before = set(multiprocessing.active_children())
    with LLM(checkpoint, **ENGINE, num_kv_blocks=24, tensor_parallel_size=2) as llm:
        yield llm
    assert not _ranks_left(before)


def _ranks_left(before):
    """The child processes started since `before` (a set of them) that are still running."""
    return set(multiprocessing.active_children()) - before


def _prompts(count, seed=0, longest=60):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(1, longest))] for _ in range(count)]


def _same_up_to_a_tie(hf_model, prompt, tokens, reference):
    """Equal greedy tokens, or equal up to a step whose two best logits tie within float32 noise:
    two ranks' partial sums add in another order than one GEMM's."""
    if tokens == reference:
        return True
    step = next(i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)
    with torch.no_grad():
        top2 = hf_model(torch.tensor([prompt + reference[:step]])).logits[0, -1].topk(2).values
    return (top2[0] - top2[1]).item() < 1e-4


def test_greedy_tokens_match_one_process_and_transformers(tp, single, hf_model):
    prompts = _prompts(4, longest=40)
    params = SamplingParams(temperature=0, max_tokens=10)
    outputs = [o.token_ids for o in tp.generate(prompts, params)]
    for prompt, tokens in zip(prompts, outputs):
        assert _same_up_to_a_tie(hf_model, prompt, tokens, single.generate(prompt, params)[0].token_ids)
        assert _same_up_to_a_tie(hf_model, prompt, tokens, hf_greedy(hf_model, prompt, 10))
    assert tp.model is None and tp.kv_cache is None  # both live in the ranks


def test_load_with_preemption_gives_each_request_its_tokens_alone(tp, single, hf_model):
    """16 requests, greedy and seeded sampling mixed, through a cache that holds 3 at full length:
    the ranks mirror preemptions and recomputations, and every request gets what it gets alone."""
    rng = random.Random(1)
    prompts = _prompts(16, seed=1)
    params = [SamplingParams(temperature=0 if i % 3 else 0.8, top_k=20, seed=i, max_tokens=rng.randint(1, 30))
              for i in range(16)]
    outputs = tp.generate(prompts, params)
    assert tp.scheduler.num_preemptions > 0
    assert tp.scheduler.block_manager.num_free_blocks == 24
    for prompt, p, out in zip(prompts, params, outputs):
        reference = single.generate(prompt, p)[0].token_ids
        assert out.token_ids == reference if p.temperature else _same_up_to_a_tie(hf_model, prompt, out.token_ids,
                                                                                   reference)


def test_stream_closed_early_leaves_the_ranks_in_step(tp, single):
    params = SamplingParams(temperature=0, max_tokens=40)
    stream = tp.generate_stream([[1, 2, 3]] * 3, params)
    for _ in range(4):
        next(stream)
    stream.close()  # a step launched and never read
    assert tp.generate([7, 8, 9], params)[0].token_ids == single.generate([7, 8, 9], params)[0].token_ids


def test_qkv_biases_split_with_their_rows(tmp_path):
    before = set(multiprocessing.active_children())
    hf_model = build_hf_model("qwen2")
    path = save_checkpoint(hf_model, tmp_path / "qwen2")
    prompts = _prompts(2, seed=2, longest=30)
    with LLM(path, **ENGINE, tensor_parallel_size=2) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    for prompt, out in zip(prompts, outputs):
        assert _same_up_to_a_tie(hf_model, prompt, out.token_ids, hf_greedy(hf_model, prompt, 8))
    assert not _ranks_left(before)


@pytest.mark.parametrize("size, match", [
    (0, "tensor_parallel_size must be a positive int, got 0"),
    ("2", "tensor_parallel_size must be a positive int, got '2'"),
    (True, "tensor_parallel_size must be a positive int"),
    (3, r"tensor_parallel_size=3 must divide the model's num_attention_heads \(4\) and num_key_value_heads \(2\)"),
])
def test_bad_sizes_are_refused_before_any_rank_starts(size, match):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=match):
        LLM("tiny", mode="eager", tensor_parallel_size=size)
    assert not _ranks_left(before)


def test_quantized_weights_are_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 takes unquantized weights only"):
        LLM("tiny", mode="eager", quantization="int8", tensor_parallel_size=2)


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    # As on a one-GPU machine: the check runs before anything touches the GPU.
    monkeypatch.setattr("fuselab.engine.engine_config.has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 GPUs, one per rank; 1 is visible"):
        LLM("tiny", device="cuda", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="rank r on cuda:r"):
        LLM("tiny", device="cuda:1", tensor_parallel_size=2)


@pytest.mark.gpu
def test_more_ranks_than_visible_gpus_is_refused():
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"needs {n + 1} GPUs"):
        LLM("tiny", tensor_parallel_size=n + 1)


def test_a_failing_rank_fails_the_engine_naming_it(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan"
    broken.mkdir()
    (broken / "config.json").write_text((checkpoint / "config.json").read_text())
    tensors = load_file(checkpoint / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"][0, -1] = float("nan")  # in rank 1's columns only
    save_file(tensors, broken / "model.safetensors")
    before = set(multiprocessing.active_children())
    with pytest.raises(TensorParallelError, match=r"(?s)rank 1 failed:.*Traceback.*holds NaN"):
        LLM(broken, **ENGINE, tensor_parallel_size=2)
    assert not _ranks_left(before)


def test_dropped_engine_stops_its_ranks(checkpoint):
    before = set(multiprocessing.active_children())
    llm = LLM(checkpoint, **ENGINE, tensor_parallel_size=2)
    assert len(_ranks_left(before)) == 2
    del llm
    gc.collect()
    assert not _ranks_left(before)


def test_ranks_end_when_the_callers_process_is_killed(tmp_path):
    script = tmp_path / "caller.py"
    script.write_text(
        "import multiprocessing, sys, time\n"
        "from fuselab.engine import LLM\n"
        "if __name__ == '__main__':\n"
        "    llm = LLM('tiny', mode='eager', tensor_parallel_size=2)\n"
        "    print(*(p.pid for p in multiprocessing.active_children()), flush=True)\n"
        "    time.sleep(3600)\n")
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        ranks = [int(pid) for pid in caller.stdout.readline().split()]
    finally:
        caller.kill()
        caller.wait()
    assert len(ranks) == 2
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in ranks)


def _running(pid):
    """Whether process pid runs (an exited one that nobody reaped is a zombie, state Z: it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_generate_cli_takes_tensor_parallel_size(capsys):
    argv = ["generate", "--model", "tiny", "--prompt", "hi", "--mode", "eager", "--tensor-parallel-size", "3"]
    assert main(argv) == 2
    assert "tensor_parallel_size=3 must divide" in capsys.readouterr().err


# Rank targets for WorkerGroup: module-level, so that a spawned rank can import them.

def _answering_rank(rank, size, commands, reply, rendezvous, behaviour):
    while (command := commands()) is not None:
        if rank == 1 and command == "step":
            if behaviour == "raise":
                raise RuntimeError(f"rank {rank} cannot take {command!r}")
            if behaviour == "hang":
                time.sleep(3600)
            if behaviour == "die":
                os._exit(3)
        reply((rank, command))


def _group(behaviour):
    group = WorkerGroup(_answering_rank, 2, (behaviour,))
    group.send("warm-up")  # both ranks started: what follows is timed from here
    assert group.receive_all(60, "warm-up") == [(0, "warm-up"), (1, "warm-up")]
    return group


def test_worker_group_answers_in_rank_order():
    before = set(multiprocessing.active_children())
    group = _group("answer")
    try:
        group.send("step")
        group.send("next")
        assert group.receive(1, 10, "step") == (1, "step")
        assert group.receive_all(10, "steps") == [(0, "step"), (1, "next")]
    finally:
        group.close()
    assert not _ranks_left(before)
    with pytest.raises(TensorParallelError, match="closed"):
        group.send("after close")


@pytest.mark.parametrize("behaviour, match", [
    ("raise", r"(?s)rank 1 failed:\nTraceback.*in _answering_rank.*RuntimeError: rank 1 cannot take 'step'"),
    ("die", "rank 1 exited with code 3 without an error"),
    ("hang", r"rank 1 did not answer step within 2 s"),
])
def test_a_rank_that_fails_dies_or_hangs_fails_the_caller_in_bounded_time(behaviour, match):
    before = set(multiprocessing.active_children())
    group = _group(behaviour)
    group.send("step")
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=match):
        group.receive_all(2, "step")
    assert time.monotonic() - start < 5
    assert not _ranks_left(before)
    with pytest.raises(TensorParallelError, match="have stopped"):
        group.send("again")
