"""The HPC checkpoints of a folder, ``hpc_ckpt_<N>.ckpt``: the one a (requeued) job resumes from, and the number
the next one gets.

Lightning 1.6.5 counted every name in the folder that contains ``hpc_ckpt_`` (for the next number: ``ckpt_``) and
read its version from all the digits in the name. The temporary file of a save killed mid-write,
``hpc_ckpt_2.ckpt.<host id>.<pid>.<8 hex digits>.tmp`` (see :mod:`~pytorch_lightning.utilities.atomic_save`), then
read as a version of 15 digits or more, so every requeued job tried to resume from a file that does not exist; and
a name such as ``hpc_ckpt_backup.ckpt`` (no digits) raised a ``ValueError``.

The hooks are ``CheckpointConnector._hpc_resume_path`` and ``CheckpointConnector.hpc_save_path``.
"""
# fork-feature: fork/streaming-atomic-save.patch
import os
import re
from typing import Optional

from pytorch_lightning.utilities.cloud_io import get_filesystem
from pytorch_lightning.utilities.types import _PATH

#: the name of a committed HPC checkpoint, its version written as Lightning writes it (no leading zeros), so that the
#: resume path built from the version names this very file
_HPC_CHECKPOINT_NAME = re.compile(r"^hpc_ckpt_(0|[1-9][0-9]*)\.ckpt$")


def max_hpc_checkpoint_version(dir_path: _PATH) -> Optional[int]:
    """The highest ``N`` of the checkpoints ``hpc_ckpt_<N>.ckpt`` in ``dir_path``; ``None`` if there is none.

    Only that exact name counts: not the temporary file of a save in progress or killed mid-write
    (``hpc_ckpt_<N>.ckpt.<...>.tmp``), nor any other name that merely contains ``hpc_ckpt_`` or ``ckpt_``
    (``hpc_ckpt_backup.ckpt``, ``my_ckpt_7.ckpt``). A directory of that name (a DeepSpeed checkpoint) counts.

    Args:
        dir_path: a local or ``fsspec`` folder; one that does not exist holds no checkpoint.
    """
    fs = get_filesystem(dir_path)
    if not fs.exists(dir_path):
        return None
    names = (os.path.basename(str(entry["name"]).rstrip("/")) for entry in fs.listdir(dir_path))
    versions = [int(match.group(1)) for match in map(_HPC_CHECKPOINT_NAME.match, names) if match]
    return max(versions, default=None)
