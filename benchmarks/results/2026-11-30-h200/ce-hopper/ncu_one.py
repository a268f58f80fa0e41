import importlib, sys, os
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
mod = importlib.import_module(sys.argv[1])
cfg = eval(sys.argv[2])
x = torch.randn(8192, 128256, device="cuda", dtype=torch.bfloat16)
t = torch.randint(0, 128256, (8192,), device="cuda")
for _ in range(3):
    mod.run(x, t, *cfg)
torch.cuda.synchronize()
