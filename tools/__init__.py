"""Device scripts, run queues and cache tooling for the benchmarks (not benchmarks themselves)."""
