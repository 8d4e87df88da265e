"""Convert a Lightning checkpoint file into a layout another trainer loads, one tensor at a time:

    python -m pytorch_lightning.utilities.convert_checkpoint last.ckpt last.dcp --to dcp
    python -m pytorch_lightning.utilities.convert_checkpoint last.ckpt hub/ --to safetensors --strip-prefix model.
    python -m pytorch_lightning.utilities.convert_checkpoint run/step-1000 last.ckpt --from dcp --add-prefix model.

``--from dcp`` goes the other way: a torch DCP directory into a fork checkpoint file (see
:mod:`~pytorch_lightning.utilities.dcp_import`).

``--to safetensors`` writes the model weights as the Hugging Face Hub lays them out (``model.safetensors``, or shards
of at most ``--max-shard-size`` with ``model.safetensors.index.json``), keeping the keys under ``--strip-prefix`` with
the prefix stripped (Lightning's attribute, ``model.``), in ``--dtype``, each tied duplicate that ``--tie KEEP=DROP``
names dropped where its values equal the kept weight's (see
:mod:`~pytorch_lightning.utilities.safetensors_export`); it needs ``safetensors`` and ``huggingface_hub``.

``--to dcp`` writes a torch Distributed Checkpoint (DCP) directory holding ``{"model": <the state_dict>, "optim":
<the optimizer state keyed by parameter name>}``, what torch's ``get_state_dict``/``set_state_dict`` give and take, so
a torch FSDP or FSDP2 (``fully_shard``) job at any scale loads it with ``dcp.load`` (each rank reads only its shards)
and ``set_state_dict``. (torchtitan's keys are ``"model"``, or the model's keys at the top level, and
``"optimizer"``, its optimizer state flattened.)

The source is memory-mapped and the tensors are written one after the other, so the conversion needs about one
tensor of memory beyond the file's pages in the page cache. Each record of the source is checked against its CRC-32
as it is first read (see :mod:`~pytorch_lightning.utilities.checkpoint_verification`): a corrupt source fails the
conversion with ``CheckpointError``. The output is written into a temporary sibling
directory (``.<DST>.<host id>.<pid>.<random>.converting``) and renamed to ``DST`` at the end: a conversion that fails
or is interrupted leaves nothing, and the next conversion into the same folder removes what a killed one left.
"""
# fork-feature: fork/checkpoint-converter.patch
import argparse
import os
import re
import secrets
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from fsspec.utils import get_protocol
from torch.distributed.checkpoint import CheckpointException, DefaultSavePlanner
from tqdm import tqdm

from pytorch_lightning.utilities.apply_func import apply_to_collection
from pytorch_lightning.utilities.atomic_save import (
    _fsync_directory,
    _process_exists,
    _writer_host_id,
    STALE_TEMPORARY_FILE_AGE,
)
from pytorch_lightning.utilities.checkpoint_location import _redacted
from pytorch_lightning.utilities.dcp_import import _import_dcp, _root_cause
from pytorch_lightning.utilities.checkpoint_verification import (
    _check_record_of,
    _close_read_check,
    _finish_read_check,
    _open_read_check,
)
from pytorch_lightning.utilities.cloud_io import load as pl_load
from pytorch_lightning.utilities.exceptions import CheckpointError, MisconfigurationException
from pytorch_lightning.utilities.host_memory import format_bytes
from pytorch_lightning.utilities.named_optimizer_state import named_optimizer_state
from pytorch_lightning.utilities.safetensors_export import (
    _published_weights,
    _require_packages,
    _write_safetensors,
    DEFAULT_MAX_SHARD_SIZE,
    DTYPES,
)
from pytorch_lightning.utilities.streamed_checkpoint_file import _streamed_save_available
from pytorch_lightning.utilities.types import _PATH

#: a conversion's work directory (``converting``) or a ``--force``\\d destination being replaced (``replaced``)
_WORK_DIRECTORY = re.compile(
    r"^\..+\.(?P<host>[0-9a-f]{12})\.(?P<pid>[1-9][0-9]*)\.[0-9a-f]{8}\.(?:converting|replaced)$"
)


def convert_checkpoint(
    src: _PATH,
    dst: _PATH,
    to: str = "dcp",
    force: bool = False,
    progress: bool = True,
    strip_prefix: str = "",
    dtype: Optional[str] = None,
    max_shard_size: Optional[str] = None,
    tie: Sequence[str] = (),
) -> None:
    """Convert the Lightning checkpoint file ``src`` into ``dst`` in the layout ``to`` (see :data:`FORMATS`).

    Args:
        src: a checkpoint file written by ``Trainer.save_checkpoint`` (of this fork's FSDP strategy, or any
            checkpoint whose optimizer state names its parameters, see
            :func:`~pytorch_lightning.utilities.named_optimizer_state.named_optimizer_state`).
        dst: the path to write; nothing is there until the conversion succeeded.
        to: the target layout, a key of :data:`FORMATS`.
        force: replace an existing ``dst``.
        progress: show a progress bar (bytes and tensors written) on stderr.
        strip_prefix: ``"safetensors"``: publish only the weights under this prefix of the ``state_dict``, without
            it (``"model."`` for a LightningModule whose model is ``self.model``).
        dtype: ``"safetensors"``: ``"float32"`` (the default), ``"bfloat16"`` or ``"float16"``.
        max_shard_size: ``"safetensors"``: the largest shard, as huggingface_hub reads it (default ``"5GB"``).
        tie: ``"safetensors"``: ``KEEP=DROP`` names of tied weights (after the prefix): ``DROP`` is left out where
            its values equal ``KEEP``'s.

    Raises:
        MisconfigurationException: ``dst`` exists and ``force`` is off, ``src`` is not a checkpoint this layout
            can express, or an option does not apply to the layout; nothing was written.
        CheckpointError: a record of ``src`` does not match its CRC-32 (``PL_CHECKPOINT_VERIFY=0`` skips the check,
            see :mod:`~pytorch_lightning.utilities.checkpoint_verification`); nothing was written.
    """
    src, dst = _local_paths(src, dst)
    if to not in FORMATS:
        raise MisconfigurationException(f"Unknown target layout {to!r}; known: {', '.join(FORMATS)}.")
    options = _Options(strip_prefix, dtype, max_shard_size, tuple(tie))
    if to != "safetensors" and options != _Options():
        raise MisconfigurationException(
            "`--strip-prefix`, `--dtype`, `--max-shard-size` and `--tie` apply to `--to safetensors` only."
        )
    if to == "safetensors":
        _require_packages()
        if options.dtype is not None and options.dtype not in DTYPES:
            raise MisconfigurationException(f"Unknown dtype {options.dtype!r}; known: {', '.join(DTYPES)}.")
    _check_folder_of(dst)
    remove_stale_conversions(dst.parent)
    if (dst.exists() or dst.is_symlink()) and not force:
        raise MisconfigurationException(f"{dst} exists; pass `--force` (`force=True`) to replace it.")
    checkpoint = _load(src)
    # the source's records are checked against their CRC-32s as the writer reads them, the rest before the move
    check = _open_read_check(src, checkpoint)
    state = FORMATS[to].prepare(checkpoint, src, options)
    work = _new_work_directory(dst, "converting")
    try:
        FORMATS[to].write(state, work, progress, options)
        # the optimizer state's records are checked where it is converted: not for the model's weights alone
        _finish_read_check(check, optimizer_states_read=to != "safetensors")
        _move_into_place(work, dst, force)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        _close_read_check(check)
        raise


def _local_paths(*paths: _PATH) -> Tuple[Path, ...]:
    """``paths`` as local paths.

    Raises:
        MisconfigurationException: if one is a URL: the converter reads and writes local files only.
    """
    remote = [str(path) for path in paths if get_protocol(str(path)) not in ("file", "local")]
    if remote:
        raise MisconfigurationException(
            f"{_redacted(remote[0])} is a URL: the converter reads and writes local paths only (object storage for it"
            " is not supported yet). Copy the checkpoint to a local disk, convert it there, and upload the result."
        )
    return tuple(Path(str(path)[len("file://") :] if str(path).startswith("file://") else path) for path in paths)


def _check_folder_of(dst: Path) -> None:
    """Check that the folder ``dst`` goes into exists: it is not made, so that a mistyped path does not become new
    folders.

    Raises:
        MisconfigurationException: if it does not.
    """
    if not dst.parent.is_dir():
        raise MisconfigurationException(f"{dst.parent} is not a directory: create it first, or write elsewhere.")


def _load(src: Path) -> Any:
    """The checkpoint, its tensors memory-mapped (``torch.load(mmap=True, weights_only=True)`` through the fork's
    safe loader: ``PL_UNSAFE_CHECKPOINT_LOAD=1`` unpickles a trusted file fully)."""
    if not src.is_file():
        raise MisconfigurationException(f"{src} is not a file.")
    try:
        return pl_load(str(src), map_location="cpu", mmap=True)
    except Exception as ex:
        raise MisconfigurationException(
            f"{src} cannot be read as a PyTorch checkpoint: {type(ex).__name__}: {_one_line(ex)}"
        ) from ex


def _one_line(ex: BaseException) -> str:
    return " ".join(str(ex).split())


class _Options(NamedTuple):
    """The options of ``--to safetensors`` (see :func:`convert_checkpoint`)."""

    strip_prefix: str = ""
    dtype: Optional[str] = None
    max_shard_size: Optional[str] = None
    tie: Tuple[str, ...] = ()


def _state_dict(checkpoint: Any, src: Path) -> Dict[str, Any]:
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        found = sorted(map(str, checkpoint))[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise MisconfigurationException(
            f"{src} is not a Lightning checkpoint: it holds no `state_dict` (found {found})."
        )
    return checkpoint["state_dict"]


def _lightning_parts(checkpoint: Any, src: Path, options: _Options) -> Dict[str, Any]:
    """``{"model": state_dict, "optim": named optimizer state}`` (``optim`` only if the file has an optimizer)."""
    _state_dict(checkpoint, src)
    optimizer_states = checkpoint.get("optimizer_states") or []
    if len(optimizer_states) > 1:
        raise MisconfigurationException(
            f"{src} holds {len(optimizer_states)} optimizer states; torch's state-dict layout holds one optimizer."
        )
    parts = {"model": checkpoint["state_dict"]}
    if optimizer_states:
        try:
            parts["optim"] = named_optimizer_state(optimizer_states[0])
        except MisconfigurationException as ex:
            raise MisconfigurationException(f"{src}: {ex}") from ex
    return apply_to_collection(parts, torch.Tensor, _standalone)


def _standalone(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on a storage of its own bytes, sharing them: DCP's writer clones a view into a larger storage (the
    fork's optimizer state is views into one record per FSDP unit) and keeps every tensor of a file until the file
    is written, which would hold the whole optimizer state in memory."""
    storage = tensor.untyped_storage()
    if storage.nbytes() == tensor.nbytes or not tensor.is_contiguous():
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    own = storage[start : start + tensor.nbytes]
    return torch.empty(0, dtype=tensor.dtype).set_(own, 0, tensor.shape, tensor.stride())


def _weights(checkpoint: Any, src: Path, options: _Options) -> Dict[str, torch.Tensor]:
    """The weights ``--to safetensors`` publishes (see ``_published_weights``)."""
    return _published_weights(_state_dict(checkpoint, src), options.strip_prefix, options.tie)


def _write_weights(weights: Dict[str, torch.Tensor], directory: Path, progress: bool, options: _Options) -> None:
    dtype = DTYPES[options.dtype or "float32"]
    with _progress_bar(sum(t.nbytes for t in weights.values()), progress) as bar:
        _write_safetensors(weights, directory, dtype, options.max_shard_size or DEFAULT_MAX_SHARD_SIZE, bar)


def _progress_bar(total: int, progress: bool) -> tqdm:
    """A bar of the bytes written, on stderr (off where ``progress`` is false)."""
    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="converting",
        disable=not progress,
        file=sys.stderr,
        mininterval=0.5,
    )


def _write_dcp(state: Dict[str, Any], directory: Path, progress: bool, options: _Options) -> None:
    """``torch.distributed.checkpoint.save`` of ``state`` into ``directory`` by this process alone."""
    tensors = _tensors(state)
    with _progress_bar(sum(t.nbytes for t in tensors), progress) as bar:
        planner = _ProgressPlanner(bar, len(tensors))
        writer = dcp.FileSystemWriter(str(directory), single_file_per_rank=True, sync_files=True, thread_count=1)
        with warnings.catch_warnings():
            # ``no_dist=True`` is meant: one process writes every tensor
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            try:
                dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
            except CheckpointException as ex:
                # DCP wraps whatever its steps raise, Ctrl-C and a full disk alike: raise the error itself
                raise _root_cause(next(iter(ex.failures.values()))[0]) from None


def _tensors(obj: Any) -> List[torch.Tensor]:
    found: List[torch.Tensor] = []
    apply_to_collection(obj, torch.Tensor, found.append)
    return found


class _ProgressPlanner(DefaultSavePlanner):
    """torch's default save planner, counting each tensor as the writer fetches it to write it."""

    def __init__(self, bar: tqdm, count: int) -> None:
        super().__init__()
        self._bar, self._count, self._done = bar, count, 0

    def resolve_data(self, write_item: Any) -> Any:
        data = super().resolve_data(write_item)
        if isinstance(data, torch.Tensor):
            _check_record_of(data)
            self._done += 1
            self._bar.set_postfix_str(f"{self._done}/{self._count} tensors", refresh=False)
            self._bar.update(data.nbytes)
        return data


class _Format:
    """A target layout: ``prepare`` checks the loaded checkpoint and builds what ``write`` writes into a new
    directory, each with the :class:`_Options`."""

    def __init__(
        self,
        help: str,
        prepare: Callable[[Any, Path, _Options], Any],
        write: Callable[[Any, Path, bool, _Options], None],
    ) -> None:
        self.help, self.prepare, self.write = help, prepare, write


#: the layouts ``--to`` names
FORMATS: Dict[str, _Format] = {
    "dcp": _Format(
        "a torch Distributed Checkpoint directory holding {'model': state_dict, 'optim': optimizer state by"
        " parameter name}, as torch's get_state_dict/set_state_dict give them",
        _lightning_parts,
        _write_dcp,
    ),
    "safetensors": _Format(
        "the model weights as the Hugging Face Hub lays them out: model.safetensors, or shards of at most"
        " --max-shard-size with model.safetensors.index.json",
        _weights,
        _write_weights,
    ),
}


def _new_work_directory(dst: Path, kind: str) -> Path:
    """A new, empty ``.<dst name>.<host id>.<pid>.<random>.<kind>`` next to ``dst``: the name says which process
    writes it, so that :func:`remove_stale_conversions` can tell a conversion in progress from a killed one's."""
    while True:
        work = dst.parent / f".{dst.name}.{_writer_host_id()}.{os.getpid()}.{secrets.token_hex(4)}.{kind}"
        try:
            work.mkdir()
            return work
        except FileExistsError:
            continue


def _move_into_place(work: Path, dst: Path, force: bool) -> None:
    """Rename ``work`` to ``dst``; with ``force``, an existing ``dst`` is moved aside first and removed after."""
    aside: Optional[Path] = None
    if force and (dst.exists() or dst.is_symlink()):
        aside = _new_work_directory(dst, "replaced")
        os.replace(dst, aside / dst.name)
    elif dst.exists() or dst.is_symlink():
        raise MisconfigurationException(f"{dst} was created while converting; pass `--force` to replace it.")
    try:
        os.rename(work, dst)
    except BaseException:
        if aside is not None:
            os.replace(aside / dst.name, dst)
        raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    _fsync_directory(str(dst.parent))


def remove_stale_conversions(folder: _PATH) -> List[str]:
    """Remove the work directories that killed conversions left in ``folder`` and return their paths: those made on
    this host (in this PID namespace) by a process that no longer exists, and those made elsewhere that have not been
    modified for 24 hours.

    Args:
        folder: the folder of a conversion's destination.
    """
    host, removed = _writer_host_id(), []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        match = _WORK_DIRECTORY.match(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        if match["host"] == host:
            stale = not _process_exists(int(match["pid"]))
        else:
            stale = time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMPORARY_FILE_AGE.total_seconds()
        if stale:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pytorch_lightning.utilities.convert_checkpoint",
        description="Convert a Lightning checkpoint file into a layout another trainer loads, one tensor at a time"
        " from the memory-mapped file. Nothing is written unless the conversion succeeds.",
        epilog="targets: " + "; ".join(f"{name}: {fmt.help}" for name, fmt in FORMATS.items()) + ". The file is"
        " loaded with torch.load(weights_only=True); PL_UNSAFE_CHECKPOINT_LOAD=1 unpickles a trusted file fully. Exit"
        " codes: 0 converted; 1 writing failed; 2 refused (DST exists, or SRC cannot be converted); 130 and 143"
        " interrupted (SIGINT, SIGTERM). On failure nothing is written.",
    )
    parser.add_argument(
        "src", help="the checkpoint file (Trainer.save_checkpoint); --from dcp: the DCP directory"
    )
    parser.add_argument("dst", help="the path to write")
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--to", choices=sorted(FORMATS), help="the target layout")
    direction.add_argument(
        "--from", dest="source_layout", choices=["dcp"], help="dcp: SRC is a DCP directory, DST a fork checkpoint file"
    )
    parser.add_argument(
        "--add-prefix", metavar="PREFIX", help="dcp source: put PREFIX before every parameter name (e.g. model.)"
    )
    parser.add_argument(
        "--model-key", metavar="KEY", help="dcp source: the key of the model's state ('' for the top level)"
    )
    parser.add_argument(
        "--optim-key",
        action="append",
        metavar="KEY",
        help="dcp source: the key of an optimizer's state (repeatable, in the LightningModule's order)",
    )
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    parser.add_argument(
        "--strip-prefix",
        metavar="PREFIX",
        help="safetensors: publish only the state_dict's keys under PREFIX, without it (e.g. model.)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="safetensors: the published dtype (float32)")
    parser.add_argument(
        "--max-shard-size", metavar="SIZE", help=f"safetensors: the largest shard ({DEFAULT_MAX_SHARD_SIZE})"
    )
    parser.add_argument(
        "--tie",
        action="append",
        metavar="KEEP=DROP",
        help="safetensors: leave out the tied weight DROP where its values equal KEEP's (repeatable)",
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="show no progress bar")
    return parser


def import_dcp(
    src: _PATH,
    dst: _PATH,
    force: bool = False,
    progress: bool = True,
    add_prefix: str = "",
    model_key: Optional[str] = None,
    optim_keys: Optional[Sequence[str]] = None,
) -> None:
    """Write the torch DCP directory ``src`` as a fork checkpoint file ``dst`` that the fork's Trainer resumes
    (see :mod:`~pytorch_lightning.utilities.dcp_import`), one tensor at a time.

    Args:
        src: a DCP directory: the converter's ``--to dcp``, Lightning 2.x's sharded ``FSDPStrategy`` save, or
            torchtitan's; every pickle in it is read through an allow-list, and what needs more is refused.
        dst: the file to write; nothing is there until the conversion succeeded.
        force: replace an existing file ``dst``.
        progress: show a progress bar (bytes written) on stderr.
        add_prefix: put this before every parameter name of the model and the optimizer state (``"model."``
            for a LightningModule whose model is ``self.model``), the inverse of ``strip_prefix``.
        model_key: the DCP key of the model's state (``""``: the model's keys are at the top level); ``None``
            tells it from the keys.
        optim_keys: the DCP keys of the optimizers' states, in the LightningModule's order; ``None`` tells them
            from the keys.

    Raises:
        MisconfigurationException: ``dst`` exists and ``force`` is off, or is a directory or a symbolic link, or
            ``src`` is not a DCP directory this converter reads; nothing was written.
    """
    src, dst = _local_paths(src, dst)
    if not _streamed_save_available():
        raise MisconfigurationException(
            f"`--from dcp` writes the file as the fork's streamed save does, which needs torch >= 2.5 (this is"
            f" {torch.__version__})."
        )
    if not (src / ".metadata").is_file():
        raise MisconfigurationException(f"{src} is not a DCP checkpoint directory (no `.metadata`).")
    real_src = os.path.realpath(src)
    if os.path.commonpath([os.path.realpath(dst), real_src]) == real_src:
        raise MisconfigurationException(f"{dst} is inside the DCP directory {src}: write the file elsewhere.")
    if dst.is_symlink():
        # the checkpoint writer would write through it, into whatever file or directory it names
        raise MisconfigurationException(
            f"{dst} is a symbolic link (to {os.readlink(dst)}): give the path of the file to write itself."
        )
    if dst.is_dir():
        raise MisconfigurationException(f"{dst} is a directory; `--from dcp` writes a checkpoint file.")
    _check_folder_of(dst)
    if dst.exists() and not force:
        raise MisconfigurationException(f"{dst} exists; pass `--force` (`force=True`) to replace it.")
    _import_dcp(
        src,
        dst,
        add_prefix=add_prefix,
        model_key=model_key,
        optim_keys=optim_keys,
        progress_bar=lambda total: _progress_bar(total, progress),
    )


def _free_space(folder: Path) -> str:
    try:
        return format_bytes(shutil.disk_usage(folder).free)
    except OSError:
        return "unknown"


def _raise_on_termination(signum: int, frame: Any) -> None:
    # unwinds through ``convert_checkpoint``'s cleanup, as Ctrl-C does
    raise SystemExit(128 + signum)


#: (option, argparse destination, the one direction it applies to)
_DIRECTION_OPTIONS = (
    ("--strip-prefix", "strip_prefix", "--to safetensors"),
    ("--dtype", "dtype", "--to safetensors"),
    ("--max-shard-size", "max_shard_size", "--to safetensors"),
    ("--tie", "tie", "--to safetensors"),
    ("--add-prefix", "add_prefix", "--from dcp"),
    ("--model-key", "model_key", "--from dcp"),
    ("--optim-key", "optim_key", "--from dcp"),
)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    # a caller's own handlers come back when ``main`` returns (it may run inside a larger program)
    previous = {
        signum: signal.signal(signum, _raise_on_termination)
        for signum in (signal.SIGTERM, getattr(signal, "SIGHUP", None))
        if signum is not None
    }
    direction = f"--from {args.source_layout}" if args.source_layout else f"--to {args.to}"
    foreign = [
        f"{option} applies to {only_for} only"
        for option, dest, only_for in _DIRECTION_OPTIONS
        if getattr(args, dest) is not None and direction != only_for
    ]
    if foreign:
        parser.error(f"{'; '.join(foreign)}, not to {direction}")
    try:
        if args.source_layout == "dcp":
            import_dcp(
                args.src,
                args.dst,
                force=args.force,
                progress=args.progress,
                add_prefix=args.add_prefix or "",
                model_key=args.model_key,
                optim_keys=args.optim_key,
            )
        else:
            convert_checkpoint(
                args.src,
                args.dst,
                to=args.to,
                force=args.force,
                progress=args.progress,
                strip_prefix=args.strip_prefix or "",
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
                tie=args.tie or (),
            )
    except MisconfigurationException as ex:
        parser.exit(2, f"{parser.prog}: error: {_one_line(ex)}\n")
    except CheckpointError as ex:
        parser.exit(1, f"{parser.prog}: error: {_one_line(ex)} Nothing was written.\n")
    except (OSError, RuntimeError) as ex:
        # a ``RuntimeError`` from torch's writers may hide a full disk: say what is free
        parser.exit(
            1,
            f"{parser.prog}: error: writing {args.dst} failed; nothing was written: {type(ex).__name__}:"
            f" {_one_line(ex)} ({_free_space(Path(args.dst).parent)} free on its filesystem)\n",
        )
    except KeyboardInterrupt:
        parser.exit(128 + signal.SIGINT, f"{parser.prog}: interrupted; nothing was written\n")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    print(f"wrote {args.dst}", file=sys.stderr)


if __name__ == "__main__":
    main()
