"""Measurement: kernel benchmarks and the shared harness."""
