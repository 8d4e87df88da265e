"""The multipart uploads of checkpoints whose job was killed: found by their markers, aborted by the next save or
resume of their directory.

A job killed while it uploads a checkpoint (preemption, ``kill -9``, a node lost) leaves an incomplete multipart
upload: invisible in listings, billed for its parts until it is aborted. S3's ``ListMultipartUploads`` gives key, id
and start time, but not which process started it, so the fork marks its own uploads: :func:`_write_marker` puts a
small object beside the checkpoint, ``.<name>.<host id>.<pid>.<8 hex digits>.upload``, holding the upload's key and
id, removed once the upload is completed or aborted. The next save or resume of that directory
(:func:`_abort_stale_uploads`) aborts the upload of each marker whose writer is gone, by the rule that removes the
temporary files of killed local saves (see
:func:`~pytorch_lightning.utilities.atomic_save.remove_stale_temporary_files`):

- started on this host, in this PID namespace, by a process that no longer exists;
- started elsewhere: older than ``PL_CHECKPOINT_STALE_UPLOAD_AGE`` seconds (24 hours by default), as its process
  cannot be looked up.

Errors while listing, reading or aborting (a role without ``s3:ListBucket`` or ``s3:AbortMultipartUpload``) are
logged, never raised: cleaning up must not make a save or a resume fail. A bucket lifecycle rule that aborts
incomplete multipart uploads after a day does the same for any upload (see ``docs/faults.md``).
"""
# fork-feature: fork/object-storage-checkpoints.patch
import json
import logging
import os
import re
import secrets
import time
from typing import Any, Dict, List, Optional

from fsspec import AbstractFileSystem

from pytorch_lightning.utilities.atomic_save import _process_exists, _writer_host_id
from pytorch_lightning.utilities.checkpoint_location import _redacted
from pytorch_lightning.utilities.exceptions import MisconfigurationException

log = logging.getLogger(__name__)

#: How old (in seconds) the marker of an upload started on another host must be before the upload is aborted.
STALE_UPLOAD_AGE_ENV = "PL_CHECKPOINT_STALE_UPLOAD_AGE"
_DEFAULT_STALE_UPLOAD_AGE = 24 * 3600
_MARKER_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<host>[0-9a-f]{12})\.(?P<pid>\d+)\.[0-9a-f]{8}\.upload$")


def _stale_upload_age() -> float:
    """``PL_CHECKPOINT_STALE_UPLOAD_AGE`` in seconds.

    Raises:
        MisconfigurationException: if it is not a whole number of seconds.
    """
    value = os.environ.get(STALE_UPLOAD_AGE_ENV, "").strip() or str(_DEFAULT_STALE_UPLOAD_AGE)
    if not value.isdigit():
        raise MisconfigurationException(f"`{STALE_UPLOAD_AGE_ENV}` must be a whole number of seconds, got {value!r}.")
    return float(value)


def _write_marker(fs: AbstractFileSystem, url: str, bucket: str, key: str, upload_id: str) -> str:
    """Put the marker of the upload ``upload_id`` of ``key`` in ``bucket`` (the object at ``url``) beside it; returns
    the marker's path."""
    directory, name = fs._strip_protocol(url).rsplit("/", 1)
    marker = f"{directory}/.{name}.{_writer_host_id()}.{os.getpid()}.{secrets.token_hex(4)}.upload"
    body = {"bucket": bucket, "key": key, "upload_id": upload_id, "started": time.time()}
    fs.pipe_file(marker, json.dumps(body).encode())
    return marker


def _remove_marker(fs: AbstractFileSystem, marker: str) -> None:
    """Remove an upload's marker once the upload is completed or aborted; a failure is logged (the next save finds
    the marker, and its upload gone)."""
    try:
        fs.rm_file(marker)
    except Exception as ex:
        log.warning(f"Could not remove the upload marker {_redacted(marker)} ({type(ex).__name__}).")


def _abort_stale_uploads(fs: AbstractFileSystem, directory: str) -> List[str]:
    """Abort the uploads into ``directory`` whose markers say their writer is gone (see the module's docstring) and
    remove the markers; returns the keys of the uploads aborted. Failures to list, read or abort are logged.

    Raises:
        MisconfigurationException: if ``PL_CHECKPOINT_STALE_UPLOAD_AGE`` is invalid.
    """
    aborted: List[str] = []
    max_age = _stale_upload_age()
    try:
        fs.invalidate_cache(fs._strip_protocol(directory))
        entries = fs.ls(directory, detail=True)
    except FileNotFoundError:
        return aborted
    except Exception as ex:
        log.warning(f"Could not look for stale uploads in {_redacted(directory)} ({type(ex).__name__}: {ex}).")
        return aborted
    host = _writer_host_id()
    for entry in entries:
        marker = entry.get("name", "")
        match = _MARKER_NAME.match(marker.rsplit("/", 1)[-1])
        if match is None or entry.get("type") != "file":
            continue
        if match["host"] == host:
            if _process_exists(int(match["pid"])):
                continue  # its save is in progress
        elif _age(entry) < max_age:
            continue  # its writer, elsewhere, may still be at it
        try:
            upload = json.loads(fs.cat_file(marker))
            _abort(fs, upload)
            fs.rm_file(marker)
        except Exception as ex:
            log.warning(f"Could not abort the stale upload of {_redacted(marker)} ({type(ex).__name__}: {ex}).")
            continue
        aborted.append(upload["key"])
    if aborted:
        log.info(f"Aborted {len(aborted)} multipart upload(s) left behind by killed checkpoint saves: {aborted}")
    return aborted


def _abort(fs: AbstractFileSystem, upload: Dict[str, Any]) -> None:
    try:
        fs.call_s3("abort_multipart_upload", Bucket=upload["bucket"], Key=upload["key"], UploadId=upload["upload_id"])
    except FileNotFoundError:
        pass  # ``NoSuchUpload``: completed or aborted meanwhile


def _age(entry: Dict[str, Any]) -> float:
    modified: Optional[Any] = entry.get("LastModified") or entry.get("mtime")
    if modified is None:
        return 0.0
    stamp = modified.timestamp() if hasattr(modified, "timestamp") else float(modified)
    return time.time() - stamp
