"""Benchmarks of the fork. ``python -m benchmarks.checkpoint_memory`` is the main one (see docs/checkpoint_memory.md)."""
