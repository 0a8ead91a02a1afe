"""Benchmarks: pytest-benchmark micro benchmarks and the end-to-end latency harness."""
