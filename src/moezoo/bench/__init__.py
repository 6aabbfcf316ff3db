"""Benchmarks behind `moezoo bench`: ratios against transformers' own implementations, measured in one run."""
