"""What several ops' kernels and launchers share: launch helpers and grids, row-kernel configs, input
checks, activations, residual loads and the sum of per-program partials. No op lives here."""
