"""One S3 object written in parts by several processes: S3's multipart upload, through s3fs's botocore client.

Any process that knows an upload's id may upload any of its parts; the object appears, atomically, only when the
upload is completed with the list of parts, and an aborted upload leaves no object (an earlier object at the same key
stays as it was). :class:`_MultipartUpload` is that upload: global rank 0 starts it (:meth:`_MultipartUpload.start`),
every rank uploads its parts (:meth:`_MultipartUpload.upload`), rank 0 completes or aborts it. The calls go through
s3fs (``fs.call_s3``), so credentials, endpoint, region and retries come from the client's standard configuration.

S3's rules: every part but the last is at least 5 MiB, a part is at most 5 GiB, an upload has at most 10,000 parts
(:func:`_part_size`).
"""
# fork-feature: fork/object-storage-checkpoints.patch
import asyncio
import io
import os
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

from fsspec import AbstractFileSystem
from packaging.version import Version

from pytorch_lightning.utilities.checkpoint_location import _redacted
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.stale_uploads import _abort_stale_uploads, _remove_marker, _write_marker

#: The size of the parts of a checkpoint uploaded in parts (default 16 MiB): each rank holds a few of them at a time.
PART_BYTES_ENV = "PL_CHECKPOINT_PART_BYTES"
S3_MIN_PART_BYTES = 5 * 2**20
S3_MAX_PART_BYTES = 5 * 2**30
S3_MAX_PARTS = 10_000
_DEFAULT_PART_BYTES = 16 * 2**20

#: What :meth:`_MultipartUpload.complete` needs of an uploaded part: its number, ETag and checksums.
_UploadedPart = Dict[str, Any]


def _is_multipart_store(fs: AbstractFileSystem) -> bool:
    """Whether checkpoints on ``fs`` are uploaded in parts by every rank: S3 (and S3-compatible stores) through
    s3fs, whose client makes the multipart calls."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return "s3" in protocols and callable(getattr(fs, "call_s3", None))


def _part_size(total: int) -> int:
    """The size of every part but the last of an object of ``total`` bytes: ``PL_CHECKPOINT_PART_BYTES``, grown
    (in whole MiB) so that the object has at most 10,000 parts.

    Raises:
        MisconfigurationException: if ``PL_CHECKPOINT_PART_BYTES`` is not a whole number of bytes from 5 MiB to 5 GiB.
        ValueError: if the object is larger than 10,000 parts of 5 GiB (48.8 TiB).
    """
    value = os.environ.get(PART_BYTES_ENV, "").strip() or str(_DEFAULT_PART_BYTES)
    if not value.isdigit() or not S3_MIN_PART_BYTES <= int(value) <= S3_MAX_PART_BYTES:
        raise MisconfigurationException(
            f"`{PART_BYTES_ENV}` must be a number of bytes from {S3_MIN_PART_BYTES} (5 MiB, S3's smallest part) to"
            f" {S3_MAX_PART_BYTES} (5 GiB), got {value!r}."
        )
    fewest = -(-total // S3_MAX_PARTS)
    size = max(int(value), -(-fewest // 2**20) * 2**20)
    if size > S3_MAX_PART_BYTES:
        raise ValueError(f"A checkpoint of {total} bytes does not fit S3's {S3_MAX_PARTS} parts of 5 GiB.")
    return size


class _MultipartUpload(NamedTuple):
    """The multipart upload ``upload_id`` of the object ``key`` in ``bucket`` at ``url``; a small picklable value,
    sent by global rank 0 to every rank."""

    url: str
    bucket: str
    key: str
    upload_id: str
    #: the path of its marker (see :mod:`~pytorch_lightning.utilities.stale_uploads`)
    marker: str

    @classmethod
    def start(cls, fs: AbstractFileSystem, url: str) -> "_MultipartUpload":
        """Start an upload of the object at ``url`` (no object appears until :meth:`complete`), after aborting the
        uploads into its directory that killed jobs left, and mark it as the fork's."""
        bucket, key, _ = fs.split_path(url)
        _abort_stale_uploads(fs, str(url).rsplit("/", 1)[0])
        options: Dict[str, Any] = {}
        if _client_sends_checksums(fs):
            # botocore >= 1.36 sends a CRC32 with every part; S3 keeps them only if the upload names the algorithm,
            # and then checks each part's and the whole object's
            options["ChecksumAlgorithm"] = "CRC32"
        upload_id = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key, **options)["UploadId"]
        try:
            marker = _write_marker(fs, str(url), bucket, key, upload_id)
        except BaseException:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
            raise
        return cls(str(url), bucket, key, upload_id, marker)

    def upload(self, fs: AbstractFileSystem, parts: Sequence[Tuple[int, Any]]) -> List[_UploadedPart]:
        """Upload ``parts`` (part number, bytes-like body) concurrently through s3fs's event loop; returns what
        :meth:`complete` needs of each. The client retries a failed request as configured (``SlowDown`` included)."""

        async def upload_all() -> List[Dict[str, Any]]:
            # every part's request ends before an error is raised, so that none is still uploading when the upload
            # is aborted (a part that lands after the abort would be billed until a lifecycle rule removes it)
            answers = await asyncio.gather(
                *(
                    fs._call_s3(
                        "upload_part",
                        Bucket=self.bucket,
                        Key=self.key,
                        UploadId=self.upload_id,
                        PartNumber=number,
                        Body=_reader_of(body),
                    )
                    for number, body in parts
                ),
                return_exceptions=True,
            )
            for answer in answers:
                if isinstance(answer, BaseException):
                    raise answer
            return answers

        from fsspec.asyn import sync

        answers = sync(fs.loop, upload_all)
        return [_uploaded_part(number, answer) for (number, _), answer in zip(parts, answers)]

    def complete(self, fs: AbstractFileSystem, parts: List[_UploadedPart]) -> None:
        """Make the object of ``parts`` (every part of it, from every rank) appear at :attr:`url`."""
        parts = sorted(parts, key=lambda part: part["PartNumber"])
        fs.call_s3(
            "complete_multipart_upload",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": parts},
        )
        _remove_marker(fs, self.marker)
        _invalidate_listing(fs, self.url)

    def abort(self, fs: AbstractFileSystem) -> None:
        """Abort the upload: its parts are deleted and no object appears (an earlier one stays)."""
        fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)
        _remove_marker(fs, self.marker)
        _invalidate_listing(fs, self.url)

    def __str__(self) -> str:
        return f"the multipart upload of {_redacted(self.url)}"


class _MemoryReader(io.RawIOBase):
    """A seekable file over a buffer, without a copy of it."""

    def __init__(self, buffer: Any) -> None:
        super().__init__()
        self._view, self._position = memoryview(buffer).cast("B"), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, out: Any) -> int:
        size = min(len(out), len(self._view) - self._position)
        out[:size] = self._view[self._position : self._position + size]
        self._position += size
        return size

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._view)}[whence]
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position


class _Body(io.BufferedReader):
    """A part's body that stays open: aiohttp before 3.12 closes a file body after sending it, and botocore's retry
    then seeks back to its start."""

    def close(self) -> None:
        pass


def _reader_of(body: Any) -> io.BufferedReader:
    """``body`` as a file: botocore and aiohttp then read it in chunks (for its checksum, and to send it), where a
    bytes-like body is copied whole on its way into the socket (73 MiB for two parts of 16 MiB in flight, against
    4 MiB)."""
    return _Body(_MemoryReader(body), 2**20)


def _uploaded_part(number: int, answer: Dict[str, Any]) -> _UploadedPart:
    part = {"PartNumber": number, "ETag": answer["ETag"]}
    part.update({k: v for k, v in answer.items() if k.startswith("Checksum") and k != "ChecksumType"})
    return part


def _client_sends_checksums(fs: AbstractFileSystem) -> bool:
    """Whether s3fs's botocore client adds a checksum to every part: botocore >= 1.36 with its default,
    ``request_checksum_calculation="when_supported"`` (``when_required`` turns it off, as stores that do not know the
    checksum headers need); older botocore sends none, and S3 refuses an upload that names an algorithm without them."""
    import botocore

    if Version(botocore.__version__) < Version("1.36"):
        return False
    config = getattr(getattr(getattr(fs, "_s3", None), "meta", None), "config", None)
    value = getattr(config, "request_checksum_calculation", None)
    if value is None:
        value = os.environ.get("AWS_REQUEST_CHECKSUM_CALCULATION", "") or "when_supported"
    return str(value).lower() == "when_supported"


def _invalidate_listing(fs: AbstractFileSystem, url: str) -> None:
    """Forget s3fs's cached listing of ``url``'s directory: ``ModelCheckpoint`` and the HPC numbering list it, and
    the multipart calls bypass s3fs's own invalidation."""
    invalidate = getattr(fs, "invalidate_cache", None)
    if invalidate is not None:
        path = fs._strip_protocol(url)
        invalidate(path)
        invalidate(path.rsplit("/", 1)[0])
