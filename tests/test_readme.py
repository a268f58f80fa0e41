"""Every code example of README.md runs, so the README cannot drift from the API.

Each ```python block executes in a fresh namespace. A name the block reads before defining it gets a small
stand-in from STAND_INS (tensors, a model); fuselab names never do, so each block must import what it uses
and a renamed function breaks its block. The blocks run in a directory that holds what they name there:
`trace.json.gz` (a recorded trace from tests/fixtures/doctor) and `path/to/Llama-3.2-1B` (a tiny random Llama
checkpoint with Llama 3's vocabulary size and a tokenizer). On a CPU the blocks first get the textual
CPU_SUBSTITUTIONS; on a GPU they run exactly as written.

Each `fuselab ...` command of the ```bash blocks parses with the CLI's own parser; those the README says run
on a CPU run, and the doctor's SCRIPT example runs under `fuselab doctor` on a GPU.
"""

from __future__ import annotations

import ast
import builtins
import gc
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from engine_checkpoints import build_hf_model, save_checkpoint
from fuselab.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
TRACE_FIXTURE = REPO / "tests" / "fixtures" / "doctor" / "llama_decode.json.gz"
LLAMA3_VOCAB = 128256  # so that the README's Llama 3 token ids are in range

# On a CPU: old text -> new text, applied to every block. Each must still match some block (checked below).
CPU_SUBSTITUTIONS = {
    ".cuda()": "",                                   # CPU tensors and modules
    'device="cuda"': 'device="cpu"',
    '"llama3-1b"': '"tiny"',                         # a 1B model decodes too slowly on a CPU
    "max_tokens=64": "max_tokens=4",                 # mode "fused" runs through Triton's interpreter
    "max_tokens=32": "max_tokens=4",
    "d = diagnose(lambda: model(x), steps=5, warmup=2)": "pass",  # diagnose profiles CUDA work; the GPU run keeps it
}

# `fuselab ...` commands (by their start) that the README says run on a CPU: run there, not only parsed.
RUN_ON_CPU = ("fuselab doctor --trace", "fuselab generate --model tiny")

# Stand-in sizes: small, since fused kernels on a CPU run through Triton's interpreter.
TOKENS, HIDDEN, OUT, VOCAB = 4, 64, 32, 1000
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 128  # HEAD_DIM: the rotary_dim of the README's rope_cos_sin(4096, 128, ...)
ATTN_SEQ, ATTN_HEAD_DIM = 16, 16
CACHE_BLOCKS, BLOCK_SIZE = 2, 16


def stand_ins(device: torch.device) -> dict[str, Callable[[], object]]:
    """Makers of the objects README blocks use without defining them, with shapes that fit the examples."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    def cache() -> torch.Tensor:
        return torch.zeros(CACHE_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device=device)

    return {
        "torch": lambda: torch,  # the README's blocks take `import torch` as read
        "model": lambda: torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
                                             torch.nn.Linear(HIDDEN, HIDDEN)).to(device),
        "x": lambda: randn(TOKENS, HIDDEN),
        "weight": lambda: randn(HIDDEN),
        "r": lambda: randn(TOKENS, HIDDEN),
        "gate_up": lambda: randn(TOKENS, 2 * HIDDEN),
        "w": lambda: randn(OUT, HIDDEN),
        "bias": lambda: randn(OUT),
        "q": lambda: randn(TOKENS, HEADS, HEAD_DIM),
        "k": lambda: randn(TOKENS, KV_HEADS, HEAD_DIM),
        "v": lambda: randn(TOKENS, KV_HEADS, HEAD_DIM),
        "positions": lambda: torch.arange(TOKENS, device=device),
        "logits": lambda: randn(TOKENS, VOCAB),
        "target": lambda: torch.randint(0, VOCAB, (TOKENS,), generator=gen).to(device),
        "q4": lambda: randn(1, HEADS, ATTN_SEQ, ATTN_HEAD_DIM),
        "k4": lambda: randn(1, KV_HEADS, ATTN_SEQ, ATTN_HEAD_DIM),
        "v4": lambda: randn(1, KV_HEADS, ATTN_SEQ, ATTN_HEAD_DIM),
        "k_cache": cache,
        "v_cache": cache,
        "slot_mapping": lambda: torch.arange(TOKENS, dtype=torch.int32, device=device),
        "hf_model": lambda: build_hf_model("llama3").to(device),
    }


@dataclass(frozen=True)
class Block:
    line: int  # the README line of the block's first line of code
    code: str


def readme_blocks(lang: str) -> list[Block]:
    blocks, lines = [], README.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == f"```{lang}":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            blocks.append(Block(i + 2, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return blocks


PYTHON_BLOCKS = readme_blocks("python")


def _names(node: ast.AST) -> tuple[set[str], set[str]]:
    """(names read, names bound) anywhere in node; a lambda's parameters count as bound."""
    reads, binds = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (reads if isinstance(n.ctx, ast.Load) else binds).add(n.id)
        elif isinstance(n, ast.alias):
            binds.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, ast.arg):
            binds.add(n.arg)
    return reads, binds


def free_names(code: str) -> set[str]:
    """The names a block reads before it binds them, statement by statement (a for/with header before
    its body, an assignment's value before its targets)."""
    bound, free = set(dir(builtins)), set()

    def visit(statements: list[ast.stmt]) -> None:
        for stmt in statements:
            if isinstance(stmt, (ast.For, ast.With)):
                headers = [stmt.iter, stmt.target] if isinstance(stmt, ast.For) else stmt.items
                for header in headers:
                    reads, binds = _names(header)
                    free.update(reads - bound)
                    bound.update(binds)
                visit(stmt.body)
            else:
                reads, binds = _names(stmt)
                inner = set().union(*(_names(a)[1] for a in ast.walk(stmt) if isinstance(a, ast.Lambda)))
                free.update(reads - bound - inner)
                bound.update(binds - inner)

    visit(ast.parse(code).body)
    return free


def run_block(block: Block, code: str, device: torch.device) -> None:
    makers, free = stand_ins(device), free_names(code)
    missing = sorted(free - makers.keys())
    if missing:
        pytest.fail(f"README.md:{block.line}: the block reads {missing} without defining or importing them, and "
                    f"the test has no stand-in for them (fuselab names must be imported by the block)")
    namespace = {"__name__": "__main__"} | {name: makers[name]() for name in free}
    # Blank lines in front, so that a traceback names the README's own line numbers.
    compiled = compile("\n" * (block.line - 1) + code, str(README), "exec")
    try:
        exec(compiled, namespace)
    except Exception as e:
        pytest.fail(f"README.md:{block.line}: the block raised {type(e).__name__}: {e}\n\n{code}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A directory holding the files the README's blocks name: a trace and a local checkpoint."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    root = tmp_path_factory.mktemp("readme")
    shutil.copy(TRACE_FIXTURE, root / "trace.json.gz")
    checkpoint = save_checkpoint(build_hf_model("llama3", vocab_size=LLAMA3_VOCAB, tie_word_embeddings=True),
                                 root / "path" / "to" / "Llama-3.2-1B")
    tokenizer = Tokenizer(WordLevel({f"w{i}": i for i in range(LLAMA3_VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    return root


def substitute_for_cpu(code: str) -> str:
    for old, new in CPU_SUBSTITUTIONS.items():
        code = code.replace(old, new)
    return code


def test_readme_has_the_blocks_this_test_expects():
    assert len(PYTHON_BLOCKS) >= 10, "the README's ```python blocks were not found"
    for old in CPU_SUBSTITUTIONS:
        assert any(old in block.code for block in PYTHON_BLOCKS), \
            f"CPU_SUBSTITUTIONS: {old!r} is no longer in the README"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run executes the blocks as written")
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: f"README.md:{b.line}")
def test_python_block_runs_on_the_cpu(block, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    run_block(block, substitute_for_cpu(block.code), torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: f"README.md:{b.line}")
def test_python_block_runs_as_written_on_a_gpu(block, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    run_block(block, block.code, torch.device("cuda"))
    gc.collect()  # an engine holds most of the GPU's memory for its KV cache: free it for the next block
    torch.cuda.empty_cache()


def fuselab_commands() -> list[tuple[int, str, list[str]]]:
    """(README line, the command as written, its argv) of every `fuselab ...` in the ```bash blocks."""
    commands = []
    for block in readme_blocks("bash"):
        for offset, line in enumerate(block.code.splitlines()):
            words = shlex.split(line, comments=True)
            # One line may chain commands: `pip install -e . && fuselab probe`.
            start = 0
            for end in [i for i, w in enumerate(words) if w in ("&&", "||", ";", "|")] + [len(words)]:
                command = words[start:end]
                if command and command[0] == "fuselab":
                    commands.append((block.line + offset, shlex.join(command), command[1:]))
                start = end + 1
    return commands


FUSELAB_COMMANDS = fuselab_commands()


def test_readme_commands_cover_every_command_it_shows():
    assert {argv[0] for _, _, argv in FUSELAB_COMMANDS} == {"probe", "doctor", "generate", "bench", "serve"}
    for start in RUN_ON_CPU:
        assert any(text.startswith(start) for _, text, _ in FUSELAB_COMMANDS), \
            f"RUN_ON_CPU: no README command starts with {start!r}"


@pytest.mark.parametrize("line, text, argv", FUSELAB_COMMANDS, ids=[f"README.md:{c[0]}" for c in FUSELAB_COMMANDS])
def test_bash_command_parses(line, text, argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # options that name an output file check it can be written
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"README.md:{line}: `{text}` does not parse (argparse exit {e.code})")


CPU_RUNS = [c for c in FUSELAB_COMMANDS if c[1].startswith(RUN_ON_CPU)]


@pytest.mark.parametrize("line, text, argv", CPU_RUNS, ids=[f"README.md:{c[0]}" for c in CPU_RUNS])
def test_bash_command_said_to_run_on_a_cpu_runs(line, text, argv, monkeypatch):
    monkeypatch.chdir(REPO)  # its paths are relative to the checkout
    assert main(argv) == 0, f"README.md:{line}: `{text}` failed"


def _decode_script() -> Block:
    return next(b for b in PYTHON_BLOCKS if b.code.startswith("# decode.py"))


@pytest.mark.gpu
def test_doctor_script_example_runs_under_the_doctor(tmp_path, monkeypatch):
    line, text, argv = next(c for c in FUSELAB_COMMANDS if re.search(r"\sdecode\.py$", c[1]))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "decode.py").write_text(_decode_script().code)
    assert main(argv) == 0, f"README.md:{line}: `{text}` failed"
    assert (tmp_path / "report.html").is_file()
