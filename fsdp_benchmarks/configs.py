"""The configurations the checkpoint-memory benchmark compares, side by side in one run.

Adding a configuration is one entry in :data:`CONFIGS`. A configuration maps to the build its ranks import, the
keyword arguments of ``DDPFullyShardedStrategy`` and, where it needs one, a ``CheckpointIO`` and extra environment
variables for the ranks.

``build`` (see :mod:`fsdp_benchmarks.builds`): ``"fork"`` runs on the tree the benchmark itself imports (the whole
series); ``"compat"`` on upstream 1.6.5 plus only the compat/ patches of ``patches/series``, i.e. 1.6.5 as released,
made to run on today's stack. 1.6.5 writes only rank 0's shard of the optimizer state, so a ``compat`` checkpoint is
incomplete (:attr:`BenchConfig.complete`); the benchmark checks its model weights and reports that.

``checkpoint_io`` names a ``CheckpointIO`` class as ``"module:Class"`` (built with no arguments in every rank and
passed as ``strategy(checkpoint_io=...)``). The fork's defaults stream saves into a temporary file and memory-map
checkpoints on resume (the fork/streaming-atomic-save and fork/mmap-checkpoint-load patches), so ``rank0-only``
plugs in :mod:`fsdp_benchmarks.upstream_io`, which does upstream 1.6.5's I/O on the fork's build. ``optimizer``
overrides the run's ``--optimizer`` for that configuration.

``stream_checkpoint`` is passed explicitly to every fork-build configuration, so each one measures the save path its
name says whatever the strategy's default is; with ``True`` the worker also checks the streamed file against a
gathered save (:attr:`BenchConfig.streams`). For the same reason the streamed and async configurations pin
``checkpoint_writers="rank0"`` (the default is ``"auto"``, which lets every rank write on a shared directory).

``scenario`` names the worker scenario that runs a configuration: ``save_and_resume`` runs Lightning's Trainer (its
launcher starts ranks >= 1); ``dcp_save_and_resume`` is the torch DCP peer (:mod:`fsdp_benchmarks.dcp_peer`, torch
FSDP2 and ``dcp.save``/``dcp.load`` on the same model shape and ranks, no Lightning strategy), whose ranks the runner
starts itself. A fork-build configuration whose ``strategy_kwargs`` the build's ``DDPFullyShardedStrategy`` does not
take (``checkpoint_writers`` before the parallel save exists) is skipped by the runner with a "not in this build"
note (:func:`missing_arguments`).

``storage`` says where the checkpoint goes: ``"local"`` (a file, or DCP's directory, in the run's folder) or ``"s3"``
(an object, or DCP's directory of objects, ``s3://<bucket>/<run>/<config>-n<N>.ckpt``, on a moto server the runner
starts for the invocation, each rank through its own byte-counting proxy: see :mod:`fsdp_benchmarks.checkpoint_memory`).
"""
import inspect
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
    build: str = "fork"
    #: whether the ranks agree before each collective of the checkpoint's per-unit loops (the fork's default);
    #: ``False`` only measures what the agreement costs, and leaves the ranks hanging if one of them fails
    agree_before_collectives: bool = True
    #: whether the optimizer state is saved in the portable layout (the fork's, since revision 81); ``False`` only
    #: measures the consolidated layout of revisions <= 80 (FairScale's, per FSDP root) side by side with it
    portable_optimizer_state: bool = True
    #: the worker scenario: ``save_and_resume`` (Lightning) or ``dcp_save_and_resume`` (the torch DCP peer)
    scenario: str = "save_and_resume"
    #: whether saves write the CRC-32 of every record and resumes check them (the fork's, since revision 111);
    #: ``False`` only measures what they cost: saves leave the CRC fields 0, as revisions <= 110 did, and resumes
    #: check nothing (``PL_CHECKPOINT_VERIFY=0``)
    record_crcs: bool = True
    #: where the checkpoint goes: ``"local"`` (the run's folder) or ``"s3"`` (the invocation's moto server)
    storage: str = "local"

    @property
    def remote(self) -> bool:
        """Whether the checkpoint goes to object storage (``s3://``), through a proxy per rank that counts its bytes."""
        return self.storage == "s3"

    @property
    def lightning(self) -> bool:
        """Whether the configuration runs Lightning's Trainer and strategy (its launcher starts ranks >= 1)."""
        return self.scenario == "save_and_resume"

    @property
    def complete(self) -> bool:
        """Whether the checkpoint holds the whole optimizer state: 1.6.5 (the ``compat`` build) saves rank 0's shard."""
        return self.build != "compat"

    @property
    def in_background(self) -> bool:
        """Whether the save is written in the background (``async_checkpoint=True``); then the worker saves inside
        ``fit``, where it can be, and measures the training thread's stall apart from the time to the commit."""
        return self.strategy_kwargs.get("async_checkpoint") is True

    @property
    def streams(self) -> bool:
        """Whether rank 0 streams the file while gathering; then the worker also verifies it against a gathered save."""
        return self.strategy_kwargs.get("stream_checkpoint") is True

    def build_checkpoint_io(self) -> Any:
        if self.checkpoint_io is None:
            return None
        return _resolve(self.checkpoint_io)()


def _resolve(qualified_name: str) -> Any:
    import importlib

    module, _, name = qualified_name.partition(":")
    return getattr(importlib.import_module(module), name)


_UPSTREAM_IO = "fsdp_benchmarks.upstream_io:UpstreamCheckpointIO"
_GATHERED = {"stream_checkpoint": False}
_STREAMED = {"stream_checkpoint": True, "checkpoint_writers": "rank0"}
_PURE_1_6_5 = (
    "pure 1.6.5 (compat patches only): full state dict on every rank; optimizer state is rank 0's shard only"
    " — incomplete checkpoint"
)
_FORK_GATHERED = "the fork, gathered save: full state on rank 0, then streamed to disk (stream_checkpoint=False)"
_FORK_STREAMED = (
    "the streamed save: rank 0 writes the file while gathering unit by unit (stream_checkpoint=True,"
    " checkpoint_writers='rank0')"
)
_ASYNC = {**_STREAMED, "async_checkpoint": True}
_FORK_ASYNC = (
    "the streamed save in the background (async_checkpoint=True): training waits while each rank copies its shards to"
    " host memory, then every rank's thread sends them to rank 0, which writes the file; measured inside fit"
)

_PARALLEL = {"stream_checkpoint": True, "checkpoint_writers": "all"}
_FORK_PARALLEL = (
    "the parallel save (checkpoint_writers='all'): rank 0 writes the skeleton, every rank pwrites its own shards into"
    " the one file; skipped on a build whose strategy has no checkpoint_writers"
)
_PARALLEL_ASYNC = {**_PARALLEL, "async_checkpoint": True}
_FORK_PARALLEL_ASYNC = (
    "the parallel save in the background (checkpoint_writers='all', async_checkpoint=True): training waits while each"
    " rank copies its shards to host memory, then every rank's thread pwrites its own copies into the one file, no"
    " unit gathered; measured inside fit"
)
_DCP = "dcp_save_and_resume"
_DCP_PEER = (
    "the peer, not Lightning: torch DCP with FSDP2 (fully_shard per block and root, same model shape and ranks, over"
    " gloo), dcp.save of get_state_dict(model, optimizer) and dcp.load into fresh sharded templates: one file per"
    " rank plus metadata, not one torch.save file"
)

_FORK_S3 = (
    "the fork's default save on S3 (stream_checkpoint=True, checkpoint_writers left at 'auto'): one object, a"
    " multipart upload that global rank 0 starts and completes, every rank uploading the parts it holds most of; the"
    " resume fetches each rank's own byte ranges (ranged GETs)"
)
_FORK_S3_RANK0 = (
    "on S3, global rank 0 alone writes the object (checkpoint_writers='rank0'): it streams the save into a local"
    " scratch file while the units are gathered and copies that into the object; the resume as fork-s3's"
)
_FORK_S3_ASYNC = (
    "the fork's default save on S3 in the background (async_checkpoint=True): training waits while each rank copies"
    " its shards to host memory, then every rank's thread uploads its parts of the one object; measured inside fit"
)
_DCP_S3 = (
    "the peer on S3: torch DCP with FSDP2 as dcp-fsdp2, dcp.save/dcp.load through torch's FsspecWriter/FsspecReader"
    " (s3fs) into an s3:// directory: one object per rank plus the metadata object"
)

_NO_CRC = (
    ", without CRC-32s: not a setting users have, it only measures what they cost (the save leaves the records'"
    " CRC fields 0, as fork revisions <= 110 did; the resume checks nothing)"
)

CONFIGS: List[BenchConfig] = [
    BenchConfig("upstream", _PURE_1_6_5, build="compat"),
    BenchConfig(
        "rank0-only",
        "the upstream PR on the fork's build: state_dict_on_rank_0_only=True with upstream's I/O; unlike 1.6.5 it"
        " also consolidates the optimizer state on rank 0 (fork/fsdp-consolidated-optimizer-state)",
        _GATHERED,
        _UPSTREAM_IO,
    ),
    BenchConfig("fork", _FORK_GATHERED, _GATHERED),
    BenchConfig("fork-stream", _FORK_STREAMED, _STREAMED),
    BenchConfig("upstream-adam", f"{_PURE_1_6_5}; Adam", build="compat", optimizer="adam"),
    BenchConfig("fork-adam", f"{_FORK_GATHERED}; Adam", _GATHERED, optimizer="adam"),
    BenchConfig("fork-stream-adam", f"{_FORK_STREAMED}; Adam", _STREAMED, optimizer="adam"),
    BenchConfig("fork-async", _FORK_ASYNC, _ASYNC),
    BenchConfig("fork-async-adam", f"{_FORK_ASYNC}; Adam", _ASYNC, optimizer="adam"),
    BenchConfig("fork-parallel", _FORK_PARALLEL, _PARALLEL),
    BenchConfig("fork-parallel-adam", f"{_FORK_PARALLEL}; Adam", _PARALLEL, optimizer="adam"),
    BenchConfig("fork-parallel-async", _FORK_PARALLEL_ASYNC, _PARALLEL_ASYNC),
    BenchConfig("dcp-fsdp2", _DCP_PEER, scenario=_DCP),
    BenchConfig("dcp-fsdp2-adam", f"{_DCP_PEER}; Adam", scenario=_DCP, optimizer="adam"),
    BenchConfig(
        "fork-stream-consolidated",
        f"{_FORK_STREAMED}, with the optimizer state in the consolidated layout of fork revisions <= 80 (FairScale's,"
        " per FSDP root, resumable only by the fork's FSDP): not a setting users have, it is the layout's baseline",
        _STREAMED,
        portable_optimizer_state=False,
    ),
    BenchConfig(
        "fork-stream-adam-consolidated",
        f"{_FORK_STREAMED}; Adam; with the optimizer state in the consolidated layout of fork revisions <= 80: not a"
        " setting users have, it is the layout's baseline",
        _STREAMED,
        optimizer="adam",
        portable_optimizer_state=False,
    ),
    BenchConfig(
        "fork-no-agreement",
        f"{_FORK_GATHERED}, without the ranks' agreement before each collective: not a setting users have, it only"
        " measures what the agreement costs (a failure on one rank would leave the others waiting)",
        _GATHERED,
        agree_before_collectives=False,
    ),
    BenchConfig(
        "fork-stream-no-agreement",
        f"{_FORK_STREAMED}, without the ranks' agreement before each collective: not a setting users have, it only"
        " measures what the agreement costs (a failure on one rank would leave the others waiting)",
        _STREAMED,
        agree_before_collectives=False,
    ),
    BenchConfig("fork-parallel-no-crc", f"{_FORK_PARALLEL}{_NO_CRC}", _PARALLEL, record_crcs=False),
    BenchConfig(
        "fork-parallel-adam-no-crc", f"{_FORK_PARALLEL}; Adam{_NO_CRC}", _PARALLEL, optimizer="adam", record_crcs=False
    ),
    BenchConfig("fork-stream-no-crc", f"{_FORK_STREAMED}{_NO_CRC}", _STREAMED, record_crcs=False),
    BenchConfig("fork-s3", _FORK_S3, {"stream_checkpoint": True}, storage="s3"),
    BenchConfig(
        "fork-s3-rank0", _FORK_S3_RANK0, {"stream_checkpoint": True, "checkpoint_writers": "rank0"}, storage="s3"
    ),
    BenchConfig("fork-s3-async", _FORK_S3_ASYNC, {"stream_checkpoint": True, "async_checkpoint": True}, storage="s3"),
    BenchConfig("dcp-fsspec-s3", _DCP_S3, scenario=_DCP, storage="s3"),
]


def by_name(name: str) -> BenchConfig:
    for config in CONFIGS:
        if config.name == name:
            return config
    raise KeyError(f"unknown configuration {name!r}; known: {', '.join(c.name for c in CONFIGS)}")


def missing_arguments(config: BenchConfig) -> List[str]:
    """The ``strategy_kwargs`` of a fork-build Lightning configuration that the ``DDPFullyShardedStrategy`` this
    process imports (the fork build's) does not take: such a configuration cannot run on this build."""
    if config.build != "fork" or not config.lightning:
        return []
    from pytorch_lightning.strategies import DDPFullyShardedStrategy

    parameters = inspect.signature(DDPFullyShardedStrategy.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []
    return [name for name in config.strategy_kwargs if name not in parameters]


def names() -> List[str]:
    return [config.name for config in CONFIGS]
