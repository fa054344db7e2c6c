"""Benchmarks: every stage against Hugging Face and against the machine's own ceilings, in one run."""
