"""SASS instruction counts of one Triton kernel compiled for sm_90, on a machine without a GPU (Triton ships
ptxas and cuobjdump). Integer arguments named n_* or stride* and all pointers get Triton's divisible-by-16
specialization, as multiples of 16 get it at run time.

    TRITON_INTERPRET=0 PYTHONPATH=. python3 sass_count.py MODULE KERNEL 'SIGNATURE_JSON' 'CONSTEXPRS_JSON' NUM_WARPS [OPTIONS_JSON]
"""

import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget


def main():
    kernel = getattr(importlib.import_module(sys.argv[1]), sys.argv[2])
    signature, constexprs = json.loads(sys.argv[3]), json.loads(sys.argv[4])
    options = {"num_warps": int(sys.argv[5]), **(json.loads(sys.argv[6]) if len(sys.argv) > 6 else {})}
    signature.update({name: "constexpr" for name in constexprs})
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(signature.items())
             if ty != "constexpr" and (ty.startswith("*") or name.startswith(("n_", "stride")))}
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin.name], capture_output=True, text=True).stdout
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9_]+)", sass, re.M)
    print(len(ops), "instructions;", " ".join(f"{op}:{n}" for op, n in collections.Counter(ops).most_common(16)))


if __name__ == "__main__":
    main()
