"""Each step copies a 256 MiB tensor from pageable host memory to the GPU, then multiplies it: the copy is the step."""

import torch

from _workload import device, parse, pick, steps

EXPECT = {"verdict": "copy-bound", "plain_verdict": "copy-bound", "rules": ["pageable-copy"], "not_rules": ["launch-gaps"],
          "copy": {"direction": "HtoD", "src": "Pageable", "bytes": 268435456}}

args = parse(__doc__)
host = torch.randn(pick(64 * 2**20, 2**16))  # float32: 256 MiB on the GPU run
for _ in steps(args):
    x = host.to(device())  # doctor-label: sync
    y = x * 2.0
