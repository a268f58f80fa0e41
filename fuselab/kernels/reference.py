"""Plain-torch references for every fused op: the tests compare against them and the eager engine runs them.

Each takes and returns tensors the way the fused op does; they favour clarity over speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# --- elementwise, norms, activations, softmax ---

# --- rope, cross-entropy, adamw ---
