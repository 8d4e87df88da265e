"""Benchmarks of the fork. ``python -m fsdp_benchmarks.checkpoint_memory`` is the main one (see
docs/checkpoint_memory.md).

Not ``benchmarks``: FairScale installs a top-level package of that name into site-packages.
"""
