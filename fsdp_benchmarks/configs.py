"""The configurations the checkpoint-memory benchmark compares, side by side in one run.

Adding a configuration is one entry in :data:`CONFIGS`. A configuration maps to the keyword arguments of
``DDPFullyShardedStrategy`` and, where it needs one, a ``CheckpointIO`` and extra environment variables for the ranks.

``checkpoint_io`` names a ``CheckpointIO`` class as ``"module:Class"`` (built with no arguments in every rank and
passed as ``strategy(checkpoint_io=...)``). The fork's defaults stream saves into a temporary file and memory-map
checkpoints on resume (the fork/streaming-atomic-save and fork/mmap-checkpoint-load patches), so the baselines plug in
:mod:`fsdp_benchmarks.upstream_io`, which does upstream 1.6.5's I/O. Every configuration, the baselines included,
consolidates the optimizer state on rank 0 (the fork/fsdp-consolidated-optimizer-state patch), which 1.6.5 did not.
``optimizer`` overrides the run's ``--optimizer`` for that configuration.

There are no separate ``stream-save``/``shared-load`` configurations: both are the fork's defaults, so ``fork``
measures them, and ``rank0-only`` (the upstream PR, with upstream's I/O) isolates what they add.
"""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass(frozen=True)
class BenchConfig:
    name: str
    description: str
    strategy_kwargs: Dict[str, Any] = field(default_factory=dict)
    checkpoint_io: Optional[str] = None
    env: Dict[str, str] = field(default_factory=dict)
    optimizer: Optional[str] = None

    def build_checkpoint_io(self) -> Any:
        if self.checkpoint_io is None:
            return None
        return _resolve(self.checkpoint_io)()


def _resolve(qualified_name: str) -> Any:
    import importlib

    module, _, name = qualified_name.partition(":")
    return getattr(importlib.import_module(module), name)


_UPSTREAM_IO = "fsdp_benchmarks.upstream_io:UpstreamCheckpointIO"
_UPSTREAM = {"state_dict_on_rank_0_only": False}

CONFIGS: List[BenchConfig] = [
    BenchConfig(
        "upstream",
        "upstream save path + consolidated optimizer state: full state dict on every rank, buffered save, plain load",
        _UPSTREAM,
        _UPSTREAM_IO,
    ),
    BenchConfig(
        "rank0-only",
        "the upstream PR + consolidated optimizer state: state_dict_on_rank_0_only=True, upstream's I/O",
        {},
        _UPSTREAM_IO,
    ),
    BenchConfig("fork", "the fork's defaults: rank-0 state dict, streaming save, mmap-shared resume"),
    BenchConfig("upstream-adam", "upstream, with Adam", _UPSTREAM, _UPSTREAM_IO, optimizer="adam"),
    BenchConfig("fork-adam", "the fork's defaults, with Adam", optimizer="adam"),
]


def by_name(name: str) -> BenchConfig:
    for config in CONFIGS:
        if config.name == name:
            return config
    raise KeyError(f"unknown configuration {name!r}; known: {', '.join(c.name for c in CONFIGS)}")


def names() -> List[str]:
    return [config.name for config in CONFIGS]
