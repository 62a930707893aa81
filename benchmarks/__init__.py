"""Benchmark suites behind ``kvtier bench``; results are written to benchmarks/results/."""
