"""A real S3-compatible server for the tests and benchmarks: ``moto``'s server (``moto[server]``, a test dependency) in
a process of its own on a free loopback port, and the clients' standard configuration that points at it.

``start_s3_server()`` runs ``python -m fsdp_harness.s3_server``, which serves moto's own WSGI application (the one
``moto_server``/``python -m moto.server`` serve) through moto's ``ThreadedMotoServer`` on ``127.0.0.1`` port 0:
the kernel picks the port when the server binds it, so two servers (two xdist workers) never race for one. The
child writes the port to a file once it listens; the parent then waits until the server answers HTTP. ``stop()``
terminates it (SIGTERM, then SIGKILL after a timeout); the child also exits by itself when its parent dies, so a
killed test run leaves no server behind.

How a client reaches it with no code of ours (what the code under test relies on: "credentials, endpoint and region
come from the client's standard configuration"): :func:`client_env` is the environment of a process that talks to
``endpoint``. botocore (>= 1.31, so boto3 and aiobotocore, hence s3fs and ``fsspec.filesystem("s3")``) reads
``AWS_ENDPOINT_URL`` (and ``AWS_ENDPOINT_URL_S3``, which would win over it, so it is removed),
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` and ``AWS_DEFAULT_REGION``. s3fs passes no ``endpoint_url`` of its own
unless given one, so the variable reaches botocore. (fsspec's own ``FSSPEC_S3_ENDPOINT_URL`` would work for s3fs only,
not for boto3, so it is not used.) The environment also points ``AWS_CONFIG_FILE``/``AWS_SHARED_CREDENTIALS_FILE``
at a file that does not exist, so a developer's ``~/.aws`` (a profile, an endpoint, ``addressing_style``) cannot
change what the tests see, and adds the loopback to ``NO_PROXY``: botocore honours ``HTTP(S)_PROXY``. botocore
addresses an IP endpoint path-style (``http://127.0.0.1:P/bucket/key``), which moto and :mod:`.s3_proxy` expect.

Checksums: botocore >= 1.36 by default (``AWS_REQUEST_CHECKSUM_CALCULATION=when_supported``) sends a CRC32 with
every ``PutObject``/``UploadPart``. Over plain HTTP, as here, it goes in a header (``x-amz-checksum-crc32``) with a
``Content-Length`` body of the object's bytes; botocore uses ``aws-chunked`` trailers only over HTTPS (they need an
unsigned payload). It also asks for and validates the checksum of a whole-object ``GetObject``
(``AWS_RESPONSE_CHECKSUM_VALIDATION=when_supported``). moto 5.2 works with both defaults and with ``when_required``
(checked by ``tests/utilities/test_s3_harness.py``): it stores the request's checksum and returns it on a full GET of
a single-``PUT`` object; it returns none on a ranged GET, nor for a multipart object whose upload named no
``ChecksumAlgorithm``, so nothing is validated there. moto checks neither the request's checksum nor its
``Content-MD5``: a body corrupted on the way is stored as is (a later full GET of a ``PutObject`` object fails
botocore's validation; a multipart object's does not). :func:`client_env` leaves botocore's defaults unless
``checksums=`` asks otherwise.

Part size: moto enforces S3's 5 MiB minimum for every part but the last (``EntityTooSmall`` at
``CompleteMultipartUpload``), read once at import from ``S3_UPLOAD_PART_MIN_SIZE`` in the *server's* environment
(``moto/settings.py``; moto documents this knob for its mock). ``start_s3_server(min_part_size=N)`` sets it, so a
test can upload small parts; the real S3 limit is the default. Lowering it also lowers moto's in-memory buffer
per object (``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE``, by default the minimum less 1 KiB, past which an object spills to
a temporary file), so the server sets that one back to its usual 5 MiB - 1 KiB.
"""
import argparse
import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]

#: S3's minimum size of every part of a multipart upload but the last; moto's default.
S3_MIN_PART_SIZE = 5 * 2**20

#: The credentials and region the clients are given; moto accepts any.
ACCESS_KEY_ID = "harness-access-key"
SECRET_ACCESS_KEY = "harness-secret-key"
REGION = "us-east-1"

#: Variables that would override or add to what :func:`client_env` sets, so they are removed from a client's
#: environment: another endpoint (the S3-specific variable wins over ``AWS_ENDPOINT_URL``; fsspec's configuration
#: would give s3fs one of its own), the switch that makes botocore ignore ``AWS_ENDPOINT_URL``, a profile, a session
#: token or another source of credentials.
_CONFLICTING = (
    "AWS_ENDPOINT_URL_S3",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_REGION",
    "FSSPEC_S3_ENDPOINT_URL",
    "FSSPEC_S3",
)


def client_env(
    endpoint: str, checksums: Optional[str] = None, max_attempts: Optional[int] = None
) -> Dict[str, Optional[str]]:
    """The environment variables of a process whose S3 clients (boto3, s3fs, ``fsspec``) talk to ``endpoint`` with
    no other configuration. A value ``None`` means: remove the variable (:func:`apply_env`, ``monkeypatch``).

    Args:
        endpoint: ``http://127.0.0.1:PORT`` of the server or of a rank's :mod:`.s3_proxy`.
        checksums: ``AWS_REQUEST_CHECKSUM_CALCULATION`` and ``AWS_RESPONSE_CHECKSUM_VALIDATION`` (``when_supported``,
            botocore's default, or ``when_required``); ``None`` leaves botocore's default.
        max_attempts: ``AWS_MAX_ATTEMPTS`` (botocore's attempts, the first included) with ``AWS_RETRY_MODE=standard``;
            ``None`` leaves botocore's defaults (legacy mode, 5 attempts, up to 1+2+4+8 s of back-off).
    """
    env: Dict[str, Optional[str]] = {name: None for name in _CONFLICTING}
    missing = str(Path(tempfile.gettempdir()) / "s3-harness-no-aws-config")
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY", ""), "127.0.0.1", "localhost"]))
    env.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID=ACCESS_KEY_ID,
        AWS_SECRET_ACCESS_KEY=SECRET_ACCESS_KEY,
        AWS_DEFAULT_REGION=REGION,
        AWS_CONFIG_FILE=missing,
        AWS_SHARED_CREDENTIALS_FILE=missing,
        AWS_EC2_METADATA_DISABLED="true",
        NO_PROXY=no_proxy,
        no_proxy=no_proxy,
    )
    if checksums is not None:
        env.update(AWS_REQUEST_CHECKSUM_CALCULATION=checksums, AWS_RESPONSE_CHECKSUM_VALIDATION=checksums)
    if max_attempts is not None:
        env.update(AWS_MAX_ATTEMPTS=str(max_attempts), AWS_RETRY_MODE="standard")
    return env


#: Ranks started with one environment (the forked ranks of ``fsdp_harness/runner.py``, Lightning's launcher) find
#: their own endpoint here: comma-separated, rank 0's first; :func:`use_rank_endpoint` picks it.
RANK_ENDPOINTS_ENV = "S3_HARNESS_RANK_ENDPOINTS"


def rank_endpoints_env(endpoints: List[str], **options: Any) -> Dict[str, Optional[str]]:
    """:func:`client_env` of rank 0's endpoint plus every rank's in :data:`RANK_ENDPOINTS_ENV`, for ranks that share
    one environment; each rank calls :func:`use_rank_endpoint` before it makes a client."""
    return {**client_env(endpoints[0], **options), RANK_ENDPOINTS_ENV: ",".join(endpoints)}


def use_rank_endpoint(rank: Optional[int] = None) -> Optional[str]:
    """In a rank's process: set ``AWS_ENDPOINT_URL`` to this rank's entry of :data:`RANK_ENDPOINTS_ENV` (``rank``, by
    default ``RANK``, else ``LOCAL_RANK``, else 0) and return it; ``None`` where the variable is not set. Call it
    before the first client: botocore reads the variable when a client is made, and s3fs caches its filesystems
    (per process: a forked rank starts with an empty cache)."""
    endpoints = os.environ.get(RANK_ENDPOINTS_ENV)
    if not endpoints:
        return None
    if rank is None:
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    os.environ["AWS_ENDPOINT_URL"] = endpoint = endpoints.split(",")[rank]
    return endpoint


def apply_env(env: Dict[str, Optional[str]], base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """``base`` (by default a copy of ``os.environ``) with ``env`` applied: a ``None`` value removes the variable."""
    out = dict(os.environ if base is None else base)
    for name, value in env.items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


_SESSION: Any = None


def _boto3_session() -> Any:
    # One session for the helpers' clients: it caches the service model, which a new session loads again (0.1-0.2 s
    # a client). Sessions are not thread-safe: make clients from one thread.
    global _SESSION
    if _SESSION is None:
        import boto3

        _SESSION = boto3.session.Session()
    return _SESSION


def boto3_client(endpoint: str, attempts: int = 3, **config: Any) -> Any:
    """A boto3 S3 client of ``endpoint``, for a test's own set-up and checks (the code under test configures itself
    from the environment instead): explicit credentials and region, ``attempts`` in all (the first included) with
    botocore's standard retries, and any other ``botocore.config.Config`` options.

    (``Config(retries={"max_attempts": N})`` counts retries, N + 1 attempts in all, whereas ``AWS_MAX_ATTEMPTS`` and
    ``total_max_attempts`` count the first attempt too: this takes the latter.)"""
    from botocore.config import Config

    config.setdefault("retries", {"total_max_attempts": attempts, "mode": "standard"})
    return _boto3_session().client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY_ID,
        aws_secret_access_key=SECRET_ACCESS_KEY,
        region_name=REGION,
        config=Config(**config),
    )


def s3fs_filesystem(endpoint: str, **kwargs: Any) -> Any:
    """A fresh (uncached) ``s3fs.S3FileSystem`` of ``endpoint`` with explicit credentials; ``kwargs`` go to it."""
    import s3fs

    kwargs.setdefault("skip_instance_cache", True)
    client_kwargs = {"region_name": REGION, **kwargs.pop("client_kwargs", {})}
    return s3fs.S3FileSystem(
        key=ACCESS_KEY_ID, secret=SECRET_ACCESS_KEY, endpoint_url=endpoint, client_kwargs=client_kwargs, **kwargs
    )


def make_bucket(endpoint: str, name: Optional[str] = None) -> str:
    """Create a bucket (a new random name unless ``name``) on ``endpoint``; returns its name."""
    name = name or f"harness-{uuid.uuid4().hex[:16]}"
    boto3_client(endpoint).create_bucket(Bucket=name)
    return name


def remove_bucket(endpoint: str, name: str) -> None:
    """Abort the bucket's multipart uploads, delete its objects and the bucket, so that a long-lived server's
    memory holds no test's data. A missing bucket is not an error."""
    client = boto3_client(endpoint)
    try:
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=name):
            for upload in page.get("Uploads", []):
                client.abort_multipart_upload(Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys})
        client.delete_bucket(Bucket=name)
    except client.exceptions.NoSuchBucket:
        pass


class S3Server:
    """A running moto server process (:func:`start_s3_server`); a context manager that stops it."""

    def __init__(self, process: subprocess.Popen, port: int, min_part_size: int, log_path: Path) -> None:
        self.process, self.port, self.min_part_size, self.log_path = process, port, min_part_size, log_path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **options: Any) -> Dict[str, Optional[str]]:
        """:func:`client_env` of this server (``options``: ``checksums``, ``max_attempts``)."""
        return client_env(self.endpoint, **options)

    def log(self) -> str:
        """What the server process printed (its errors; its requests too with ``verbose``); gone after :meth:`stop`."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` s; waits for the process either way, then removes its log.
        Idempotent."""
        _stop(self.process, timeout)
        _STARTED.discard(self.process)
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> "S3Server":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


#: Every process this interpreter started and has not stopped yet: stopped at exit should a caller forget.
_STARTED: "set[subprocess.Popen]" = set()


def _stop(process: subprocess.Popen, timeout: float) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _stop_all_started() -> None:
    for process in list(_STARTED):
        _stop(process, 2.0)


atexit.register(_stop_all_started)


def spawn_with_port_file(
    module: str, args: List[str], env: Dict[str, str], timeout: float, log_path: Path, what: str
) -> "tuple[subprocess.Popen, int]":
    """Start ``python -m module args --port-file F`` (output to ``log_path``) and wait until it writes its port to
    ``F``; shared with :mod:`.s3_proxy`. On a timeout or an early exit the process is stopped and the error says
    what it printed."""
    folder = Path(tempfile.mkdtemp(prefix="s3-harness-"))
    port_file = folder / "port"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", module, *args, "--port-file", str(port_file)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    _STARTED.add(process)
    deadline = time.monotonic() + timeout
    try:
        while not port_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                _stop(process, 2.0)
                _STARTED.discard(process)
                status = "timed out" if process.returncode is None else f"exited with {process.returncode}"
                output = log_path.read_text(errors="replace")
                log_path.unlink(missing_ok=True)
                raise RuntimeError(f"{what} {status} before listening; its output:\n{output}")
            time.sleep(0.02)
        return process, int(port_file.read_text())
    finally:
        port_file.unlink(missing_ok=True)
        folder.rmdir()


def free_loopback_port() -> int:
    """A port of 127.0.0.1 that nothing listens on right now (to point a client at a server that is gone)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_port_file(path: str, port: int) -> None:
    """Write ``port`` to ``path`` atomically (the parent polls for the file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(str(port))
    os.replace(tmp, path)


def exit_with_parent(on_exit: Any, interval: float = 0.5) -> None:
    """Run ``on_exit()`` when this process's parent dies (it is re-parented), from a daemon thread. Polling, unlike
    ``PR_SET_PDEATHSIG``, does not fire when merely the parent's *thread* that started us ends."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        on_exit()

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _wait_until_answers(endpoint: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            # moto's own status page; any HTTP answer would do.
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                f"{endpoint}/moto-api/data.json", timeout=2
            ):
                return
        except OSError as err:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the moto server at {endpoint} does not answer: {err}") from err
            time.sleep(0.05)


def start_s3_server(
    min_part_size: int = S3_MIN_PART_SIZE, timeout: float = 60.0, verbose: bool = False
) -> S3Server:
    """Start a moto server process on a free port of ``127.0.0.1`` and wait until it answers.

    Args:
        min_part_size: the smallest part but the last that ``CompleteMultipartUpload`` accepts (moto's
            ``S3_UPLOAD_PART_MIN_SIZE``); S3's 5 MiB by default.
        timeout: seconds to wait for it to listen and answer (importing moto takes 1-3 s).
        verbose: log every request to :meth:`S3Server.log` (werkzeug's access log).
    """
    env = apply_env({name: None for name in _CONFLICTING})
    env["S3_UPLOAD_PART_MIN_SIZE"] = str(min_part_size)
    env.setdefault("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE", str(S3_MIN_PART_SIZE - 1024))
    env.setdefault("AWS_DEFAULT_REGION", REGION)
    log_path = Path(tempfile.mkstemp(prefix="moto-server-", suffix=".log")[1])
    args = ["--verbose"] if verbose else []
    started = time.monotonic()
    process, port = spawn_with_port_file(__name__, args, env, timeout, log_path, "the moto server")
    server = S3Server(process, port, min_part_size, log_path)
    try:
        _wait_until_answers(server.endpoint, process, timeout - (time.monotonic() - started))
    except BaseException:
        server.stop()
        raise
    return server


def main(argv: Optional[List[str]] = None) -> None:
    """The server process: moto's WSGI application on ``127.0.0.1:<port>``, until SIGTERM/SIGINT or its parent's
    death."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--port-file", help="where to write the port once listening")
    parser.add_argument("--verbose", action="store_true", help="print werkzeug's access log")
    options = parser.parse_args(argv)

    import logging

    # werkzeug logs every request at INFO to stderr unless its logger has a level: quiet unless asked.
    logging.getLogger("werkzeug").setLevel(logging.INFO if options.verbose else logging.WARNING)
    # Imported only here: moto reads S3_UPLOAD_PART_MIN_SIZE at import.
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer("127.0.0.1", options.port, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]
    os.environ["MOTO_PORT"] = str(port)  # what moto's own launcher sets; read when moto builds its own URLs
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    exit_with_parent(done.set)
    if options.port_file:
        write_port_file(options.port_file, port)
    print(f"moto server listening on 127.0.0.1:{port}", flush=True)
    while not done.wait(1.0):
        pass
    # No server.stop(): moto keeps everything in memory (objects past its buffer in unlinked temporary files), so
    # there is nothing to flush, and shutdown() would wait out serve_forever's 0.5 s poll. The server thread is a
    # daemon: returning ends the process.


if __name__ == "__main__":
    main()
