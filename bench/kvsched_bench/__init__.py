"""kvsched-bench: what kvsched's benchmarks need beside the product — the routing baselines
(`kvsched_bench.selectors`, registered in the `kvsched.selectors` entry-point group)."""
