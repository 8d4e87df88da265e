"""The configurations the checkpoint-memory benchmark compares, side by side in one run.

Adding a configuration is one entry in :data:`CONFIGS`. A configuration maps to the keyword arguments of
``DDPFullyShardedStrategy`` and, where it needs one, a ``CheckpointIO`` and extra environment variables for the ranks.

Hook for later configurations: ``checkpoint_io`` names a ``CheckpointIO`` class as ``"module:Class"`` (built with no
arguments in every rank and passed as ``strategy(checkpoint_io=...)``). Once the fork's defaults change how files are
written or read (streaming save, mmap load), ``upstream`` must keep upstream 1.6.5's I/O: give it a small class in
``benchmarks/`` that reproduces upstream's ``atomic_save`` (``torch.save`` into a ``BytesIO``, then one write) and
plain ``torch.load``, and set ``checkpoint_io`` here. Until then upstream's I/O *is* the default, so none is set.
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

    def build_checkpoint_io(self) -> Any:
        if self.checkpoint_io is None:
            return None
        import importlib

        module, _, name = self.checkpoint_io.partition(":")
        return getattr(importlib.import_module(module), name)()


CONFIGS: List[BenchConfig] = [
    BenchConfig("upstream", "upstream 1.6.5 behaviour: full state dict on every rank", {"state_dict_on_rank_0_only": False}),
    BenchConfig("fork", "the fork's defaults"),
]


def by_name(name: str) -> BenchConfig:
    for config in CONFIGS:
        if config.name == name:
            return config
    raise KeyError(f"unknown configuration {name!r}; known: {', '.join(c.name for c in CONFIGS)}")


def names() -> List[str]:
    return [config.name for config in CONFIGS]
