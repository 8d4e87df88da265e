"""Where a checkpoint goes: its directory made (local and directory-based ``fsspec`` filesystems) or its bucket found
(object stores).

Object stores have buckets, not directories: ``fs.makedirs("s3://bucket/run")`` makes s3fs (and gcsfs) *create* the
bucket when it is missing, so a typo in a bucket name made a new bucket, billed to the account, and wrote the
checkpoint there. :func:`_prepare_checkpoint_dir` never creates a bucket: it raises, before any data moves, where the
bucket is missing or the client has no credentials, naming the URL without any secret it may carry.

The hook is ``TorchCheckpointIO.save_checkpoint``.
"""
# fork-feature: fork/object-storage-checkpoints.patch
import os
import re
from typing import Any

from fsspec import AbstractFileSystem

#: ``fsspec`` protocols of object stores, whose first path component is a bucket (or container) that ``makedirs``
#: would create.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"})


def _redacted(url: Any) -> str:
    """``url`` as it may be shown in a message or a log: without the password of its user part
    (``s3://KEY:SECRET@bucket``, where the secret may hold ``/``) nor the values of its query (pre-signed URLs carry
    their signature there)."""
    text = str(url)
    if "://" not in text:
        return text
    text = _USER_PASSWORD.sub(r"\1:***@", text)
    base, sep, query = text.partition("?")
    if not sep:
        return text
    query, hash_sign, fragment = query.partition("#")
    query = "&".join(f"{item.split('=', 1)[0]}=***" if "=" in item else item for item in query.split("&"))
    return f"{base}?{query}{hash_sign}{fragment}"


#: ``scheme://user:password@``: the password runs to the last ``@`` before the query (it may hold ``/``)
_USER_PASSWORD = re.compile(r"^([A-Za-z][\w+.-]*://[^/:@?#]+):[^?#]*@")


def _is_object_store(fs: AbstractFileSystem) -> bool:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return any(protocol in OBJECT_STORE_PROTOCOLS for protocol in protocols)


def _prepare_checkpoint_dir(fs: AbstractFileSystem, path: Any) -> None:
    """Make the directory of the checkpoint file ``path`` on ``fs``, as ``fs.makedirs(dirname, exist_ok=True)`` did,
    except on an object store, where it only checks that the bucket exists and can be reached.

    Raises:
        FileNotFoundError: if the bucket of ``path`` does not exist.
        PermissionError: if the client has no credentials, or they are refused.
        OSError: if the bucket cannot be checked for another reason (the message shows the URL without secrets).
    """
    if not _is_object_store(fs):
        fs.makedirs(os.path.dirname(str(path)), exist_ok=True)
        return
    shown = _redacted(path)
    try:
        bucket = _bucket_of(fs, path)
        found = _bucket_exists(fs, bucket)
    except Exception as ex:
        # name the cause, never the error's text, which may quote the URL with its secret or a signed request
        if isinstance(ex, PermissionError) or "Credential" in type(ex).__name__:
            raise PermissionError(
                f"The checkpoint path {shown} cannot be reached ({type(ex).__name__}): give the client credentials"
                " with access to the bucket through its standard configuration (for S3: AWS_ACCESS_KEY_ID and"
                " AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role)."
            ) from None
        raise OSError(f"The bucket of the checkpoint path {shown} cannot be checked ({type(ex).__name__}).") from None
    if not found:
        raise FileNotFoundError(
            f"The bucket {bucket!r} of the checkpoint path {shown} does not exist. Checkpoints never create a"
            " bucket: create it (or correct the path) first."
        )


def _bucket_of(fs: AbstractFileSystem, path: Any) -> str:
    """The bucket (or container) of ``path``: s3fs's own ``split_path`` where there is one (it knows S3 access-point
    ARNs, whose "bucket" holds a ``/``), else the first component of the path."""
    split_path = getattr(fs, "split_path", None)
    if split_path is not None:
        return split_path(str(path))[0]
    return fs._strip_protocol(str(path)).split("/", 1)[0]


def _bucket_exists(fs: AbstractFileSystem, bucket: str) -> bool:
    """Whether ``bucket`` exists on ``fs``: S3's ``HeadBucket`` through s3fs's client first (it raises on missing
    credentials, where ``fs.exists`` answers ``False``); where ``HeadBucket`` is refused (a role without
    ``s3:ListBucket``, a requester-pays bucket), ``fs.exists``, as 1.6.5's ``makedirs`` asked, which tries the other
    calls s3fs knows. Elsewhere ``fs.exists``."""
    call_s3 = getattr(fs, "call_s3", None)
    if call_s3 is None:
        return fs.exists(bucket)
    try:
        call_s3("head_bucket", Bucket=bucket)
    except FileNotFoundError:
        # s3fs turns 404 (NoSuchBucket) into FileNotFoundError, and 403 into PermissionError
        return False
    except PermissionError:
        if fs.exists(bucket):
            return True
        raise
    return True
