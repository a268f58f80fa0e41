"""Side-by-side benchmarks, one module per subject; each has add_arguments(parser) and run(args) -> int."""
