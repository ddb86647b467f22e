"""Benchmarks: commands that measure and write JSON (and plots), never timed unit tests."""
