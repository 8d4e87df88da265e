"""The S3 harness (fsdp_harness/s3_server.py, fsdp_harness/s3_proxy.py, tests/helpers/s3.py) does what it says: a
real moto server process, reached by real clients through a proxy process that counts bytes and injects faults.

Clients run in this process or in a subprocess; the server and the proxies are always processes of their own, and
nothing in boto3 or s3fs is patched.
"""
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import botocore
import botocore.exceptions
import fsspec
import psutil
import pytest
from packaging.version import Version

from fsdp_harness.s3_proxy import access_denied, internal_error, operation, reset_part, slow_down, start_proxy
from fsdp_harness.s3_server import (
    ROOT,
    apply_env,
    boto3_client,
    free_loopback_port,
    make_bucket,
    rank_endpoints_env,
    remove_bucket,
    s3fs_filesystem,
    use_rank_endpoint,
)

pytest_plugins = ["tests.helpers.s3"]

MiB = 2**20


def _data(size: int, seed: int) -> bytes:
    """``size`` pseudo-random bytes of ``seed``: no period, so a range read from the wrong offset shows."""
    return random.Random(seed).randbytes(size)


def _upload_parts(client, bucket, key, parts):
    """Create a multipart upload of ``key`` and upload ``parts`` (1-based numbers); returns (upload id, ETags)."""
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    etags = [
        client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body)["ETag"]
        for number, body in enumerate(parts, 1)
    ]
    return upload_id, etags


def _complete(client, bucket, key, upload_id, etags):
    parts = [{"ETag": etag, "PartNumber": number} for number, etag in enumerate(etags, 1)]
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts})


def _uploads_of(log, op="UploadPart"):
    return [(e["part_number"], e["status"], e["sent"], e["fault"]) for e in log if e["op"] == op]


@pytest.mark.timeout(60)
def test_clients_reach_the_server_from_the_environment_alone(s3_server, s3_bucket, s3_proxies):
    """A process given only ``proxy.env()`` writes with ``fsspec.open`` and reads ranges with s3fs ``cat_ranges``,
    its code naming no endpoint, credentials or region; the proxy counts what went to and came from the server."""
    proxy = s3_proxies()
    size, ranges = 3 * MiB, [(0, 100), (MiB, 2 * MiB + 17), (3 * MiB - 5, 3 * MiB)]
    script = textwrap.dedent(
        f"""
        import fsspec, json, random
        data = random.Random(7).randbytes({size})
        with fsspec.open("s3://{s3_bucket}/object", "wb") as f:
            f.write(data)
        fs = fsspec.filesystem("s3")
        starts, ends = {[r[0] for r in ranges]}, {[r[1] for r in ranges]}
        got = fs.cat_ranges(["{s3_bucket}/object"] * len(starts), starts, ends)
        print(json.dumps([g == data[s:e] for g, s, e in zip(got, starts, ends)]))
        # botocore reads the checksum setting when it makes a client, as it reads the endpoint.
        import boto3, os
        os.environ["AWS_REQUEST_CHECKSUM_CALCULATION"] = "when_required"
        boto3.client("s3").put_object(Bucket="{s3_bucket}", Key="unchecked", Body=b"data")
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], env=apply_env(proxy.env()), cwd=ROOT, capture_output=True, text=True, timeout=50
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == [True] * len(ranges)

    # The object is on the server, whole; the proxy saw every byte of it go there and the ranges come back.
    stored = boto3_client(s3_server.endpoint).get_object(Bucket=s3_bucket, Key="object")["Body"].read()
    assert stored == _data(size, 7)
    # botocore >= 1.36's default CRC32 goes as a header over plain HTTP (moto takes it); when_required drops it.
    default = "crc32" if Version(botocore.__version__) >= Version("1.36") else None
    assert [(e["path"], e["checksum"]) for e in proxy.log() if e["op"] == "PutObject"] == [
        (f"/{s3_bucket}/object", default),
        (f"/{s3_bucket}/unchecked", None),
    ]
    counts = proxy.counts()["by_op"]
    assert counts["PutObject"] == dict(requests=2, sent=size + 4, payload=size + 4, received=0, faults=0)
    assert counts["GetObjectRange"]["requests"] == len(ranges)
    assert counts["GetObjectRange"]["received"] == sum(end - start for start, end in ranges)
    assert "GetObject" not in counts  # only ranged reads


@pytest.mark.timeout(60)
def test_reset_mid_part_is_retried(s3_server, s3_bucket, s3_proxies):
    """``reset_part``: the connection dies after 1 MiB of the 2nd part's body; botocore sends the part again."""
    proxy = s3_proxies([reset_part(after_bytes=MiB, nth=2)])
    client = boto3_client(proxy.endpoint, attempts=3)
    parts = [_data(5 * MiB, 1), _data(5 * MiB, 2), _data(1000, 3)]
    upload_id, etags = _upload_parts(client, s3_bucket, "object", parts)
    _complete(client, s3_bucket, "object", upload_id, etags)

    stored = boto3_client(s3_server.endpoint).get_object(Bucket=s3_bucket, Key="object")["Body"].read()
    assert stored == b"".join(parts)
    assert _uploads_of(proxy.log()) == [
        (1, 200, 5 * MiB, None),
        (2, None, MiB, f"reset after {MiB} bytes"),
        (2, 200, 5 * MiB, None),
        (3, 200, 1000, None),
    ]
    uploads = proxy.counts()["by_op"]["UploadPart"]
    assert uploads == dict(requests=4, sent=11 * MiB + 1000, payload=10 * MiB + 1000, received=0, faults=1)


@pytest.mark.timeout(60)
def test_reset_without_retries_raises(s3_server, s3_bucket, s3_proxies):
    """With one attempt the reset reaches the caller, and the server keeps no part of the truncated body."""
    proxy = s3_proxies([reset_part(after_bytes=MiB)])
    client = boto3_client(proxy.endpoint, attempts=1)
    upload_id = client.create_multipart_upload(Bucket=s3_bucket, Key="object")["UploadId"]
    # urllib3 swallows the failed send and reads no answer: botocore calls it a closed connection.
    with pytest.raises(botocore.exceptions.ConnectionClosedError):
        client.upload_part(Bucket=s3_bucket, Key="object", UploadId=upload_id, PartNumber=1, Body=_data(5 * MiB, 1))
    parts = boto3_client(s3_server.endpoint).list_parts(Bucket=s3_bucket, Key="object", UploadId=upload_id)
    assert parts.get("Parts", []) == []


@pytest.mark.timeout(30)
def test_reset_is_a_tcp_rst(s3_bucket, s3_proxies):
    """The reset is an RST (``SO_LINGER`` 0), not an orderly close: the client's first failing call says
    ``ECONNRESET``, where a FIN would let the send succeed and the read return nothing."""
    proxy = s3_proxies([reset_part(after_bytes=1000)])
    head = f"PUT /{s3_bucket}/object?partNumber=1&uploadId=u HTTP/1.1\r\nHost: x\r\nContent-Length: {4 * MiB}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        with pytest.raises(ConnectionResetError):
            sock.sendall(head.encode())
            for _ in range(4):
                sock.sendall(_data(MiB, 1))
            sock.recv(1)
    assert _uploads_of(proxy.log()) == [(1, None, 1000, "reset after 1000 bytes")]


@pytest.mark.timeout(60)
def test_internal_error_every_time_raises_after_retries(s3_server, s3_bucket, s3_proxies):
    """``internal_error`` on part 2 only, forever: part 1 lands, part 2 fails on every attempt; the upload stays
    listed (ListMultipartUploads, ListParts) until it is aborted."""
    proxy = s3_proxies([internal_error(part_numbers=[2])])
    client = boto3_client(proxy.endpoint, attempts=2)
    upload_id = client.create_multipart_upload(Bucket=s3_bucket, Key="object")["UploadId"]
    client.upload_part(Bucket=s3_bucket, Key="object", UploadId=upload_id, PartNumber=1, Body=_data(5 * MiB, 1))
    with pytest.raises(botocore.exceptions.ClientError) as raised:
        client.upload_part(Bucket=s3_bucket, Key="object", UploadId=upload_id, PartNumber=2, Body=_data(MiB, 2))
    assert raised.value.response["Error"]["Code"] == "InternalError"
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    assert _uploads_of(proxy.log()) == [(1, 200, 5 * MiB, None)] + [(2, 500, 0, "error 500 InternalError")] * 2

    uploads = client.list_multipart_uploads(Bucket=s3_bucket)["Uploads"]
    assert [(u["Key"], u["UploadId"]) for u in uploads] == [("object", upload_id)]
    parts = client.list_parts(Bucket=s3_bucket, Key="object", UploadId=upload_id)["Parts"]
    assert [(p["PartNumber"], p["Size"]) for p in parts] == [(1, 5 * MiB)]
    client.abort_multipart_upload(Bucket=s3_bucket, Key="object", UploadId=upload_id)
    assert client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    counts = proxy.counts()["by_op"]
    assert {op: counts[op]["requests"] for op in ("ListMultipartUploads", "ListParts", "AbortMultipartUpload")} == {
        "ListMultipartUploads": 2,
        "ListParts": 1,
        "AbortMultipartUpload": 1,
    }


@pytest.mark.timeout(60)
def test_slow_down_that_clears(s3_server, s3_bucket, s3_proxies):
    """``slow_down(2)``: the first two parts' attempts get 503 SlowDown, the third passes; the upload succeeds."""
    proxy = s3_proxies([slow_down(times=2)])
    client = boto3_client(proxy.endpoint, attempts=3)
    upload_id, etags = _upload_parts(client, s3_bucket, "object", [_data(MiB, 1)])
    _complete(client, s3_bucket, "object", upload_id, etags)
    assert _uploads_of(proxy.log()) == [(1, 503, 0, "error 503 SlowDown")] * 2 + [(1, 200, MiB, None)]
    assert [(f["times"], f["fired"]) for f in proxy.faults()] == [(0, 2)]
    assert boto3_client(s3_server.endpoint).head_object(Bucket=s3_bucket, Key="object")["ContentLength"] == MiB


@pytest.mark.timeout(60)
def test_access_denied_is_not_retried_and_faults_change_at_run_time(s3_bucket, s3_proxies):
    proxy = s3_proxies([access_denied()])
    client = boto3_client(proxy.endpoint, attempts=3)
    with pytest.raises(botocore.exceptions.ClientError) as raised:
        client.create_multipart_upload(Bucket=s3_bucket, Key="object")
    assert raised.value.response["Error"]["Code"] == "AccessDenied"
    with pytest.raises(botocore.exceptions.ClientError) as raised:
        client.head_object(Bucket=s3_bucket, Key="object")  # no body to a HEAD: botocore names the status
    assert raised.value.response["Error"]["Code"] == "403"
    assert [(e["op"], e["status"]) for e in proxy.log()] == [("CreateMultipartUpload", 403), ("HeadObject", 403)]

    assert proxy.set_faults([]) == []
    client.put_object(Bucket=s3_bucket, Key="object", Body=b"allowed now")
    assert proxy.log()[-1]["op"] == "PutObject" and proxy.log()[-1]["status"] == 200


@pytest.mark.timeout(60)
def test_min_part_size_is_moto_s3_upload_part_min_size(s3_servers):
    """S3's 5 MiB minimum part applies by default (EntityTooSmall at completion); ``min_part_size`` lowers it."""
    small_parts = [_data(64 * 1024, 1), _data(1000, 2)]
    for server, refused in ((s3_servers(), True), (s3_servers(min_part_size=64 * 1024), False)):
        bucket = make_bucket(server.endpoint)
        try:
            client = boto3_client(server.endpoint)
            upload_id, etags = _upload_parts(client, bucket, "object", small_parts)
            if refused:
                with pytest.raises(botocore.exceptions.ClientError, match="EntityTooSmall"):
                    _complete(client, bucket, "object", upload_id, etags)
            else:
                _complete(client, bucket, "object", upload_id, etags)
                assert client.get_object(Bucket=bucket, Key="object")["Body"].read() == b"".join(small_parts)
        finally:
            remove_bucket(server.endpoint, bucket)


@pytest.mark.timeout(60)
def test_writing_to_a_missing_bucket(s3_server, s3_env):
    """What s3fs does with a bucket that does not exist: ``S3FileSystem.open(..., "wb")`` fails at close with
    ``FileNotFoundError`` and creates nothing, but ``fsspec.open`` (``auto_mkdir=True`` by default) creates the
    bucket first. Code that must not create buckets opens through the filesystem, or passes ``auto_mkdir=False``."""
    fs = s3fs_filesystem(s3_server.endpoint)
    with pytest.raises(FileNotFoundError, match="bucket does not exist"):
        with fs.open("harness-missing-a/object", "wb") as f:
            f.write(b"data")
    with pytest.raises(FileNotFoundError, match="bucket does not exist"):
        with fsspec.open("s3://harness-missing-b/object", "wb", auto_mkdir=False, skip_instance_cache=True) as f:
            f.write(b"data")
    try:
        with fsspec.open("s3://harness-missing-c/object", "wb", skip_instance_cache=True) as f:
            f.write(b"data")
        buckets = {b["Name"] for b in boto3_client(s3_server.endpoint).list_buckets()["Buckets"]}
        assert {"harness-missing-a", "harness-missing-b", "harness-missing-c"} & buckets == {"harness-missing-c"}
    finally:
        remove_bucket(s3_server.endpoint, "harness-missing-c")


@pytest.mark.timeout(60)
def test_proxy_relays_chunked_bodies_keep_alive_and_head(s3_bucket, s3_proxies):
    """Raw HTTP on one kept-alive connection: a chunked PUT (moto takes it unsigned), then a HEAD and a GET (signed
    as presigned URLs): the HEAD's Content-Length is the object's, with no body after it."""
    proxy = s3_proxies()
    body = [b"abc", _data(70000, 1), b"xyz"]
    connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    connection.putrequest("PUT", f"/{s3_bucket}/chunked")
    connection.putheader("Transfer-Encoding", "chunked")
    connection.endheaders()
    for piece in body + [b""]:
        connection.send(b"%x\r\n%b\r\n" % (len(piece), piece))
    response = connection.getresponse()
    assert (response.status, response.read()) == (200, b"")

    signer = boto3_client(proxy.endpoint)
    for method, client_method in (("HEAD", "head_object"), ("GET", "get_object")):
        url = urlsplit(signer.generate_presigned_url(client_method, Params={"Bucket": s3_bucket, "Key": "chunked"}))
        connection.request(method, f"{url.path}?{url.query}")
        response = connection.getresponse()
        assert response.status == 200
        assert int(response.getheader("Content-Length")) == sum(map(len, body))
        assert response.read() == (b"".join(body) if method == "GET" else b"")
    connection.close()
    counts = proxy.counts()["by_op"]
    assert counts["PutObject"]["sent"] == counts["GetObject"]["received"] == sum(map(len, body))
    assert counts["HeadObject"]["received"] == 0


class _FramingUpstream(BaseHTTPRequestHandler):
    """An upstream that answers ``/chunked`` with a chunked body and ``/unframed`` with one that ends at the close."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.send_response(200)
        if self.path == "/chunked":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in (b"chunk one,", b"chunk two"):
                self.wfile.write(b"%x\r\n%b\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"until the close")
            self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.mark.timeout(30)
def test_proxy_relays_chunked_and_unframed_responses(s3_proxies):
    """moto frames its answers with Content-Length; other servers may not: the proxy relays a chunked answer
    chunked, and one without a length ends the client's connection, as it ended the proxy's."""
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _FramingUpstream)
    threading.Thread(target=upstream.serve_forever, args=(0.05,), daemon=True).start()
    try:
        proxy = s3_proxies(upstream=f"http://127.0.0.1:{upstream.server_address[1]}")
        connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        connection.request("GET", "/chunked")
        response = connection.getresponse()
        assert (response.chunked, response.read()) == (True, b"chunk one,chunk two")
        connection.request("GET", "/unframed")  # the same connection: the chunked answer ended where it should
        response = connection.getresponse()
        assert (response.getheader("Connection"), response.read()) == ("close", b"until the close")
        connection.close()
        assert [e["received"] for e in proxy.log()] == [19, 15]
    finally:
        upstream.shutdown()
        upstream.server_close()


@pytest.mark.timeout(60)
def test_proxy_stops_on_sigterm_and_exits_with_its_parent(s3_server):
    with start_proxy(s3_server.endpoint) as proxy:
        pass
    assert proxy.process.returncode == 0  # SIGTERM: a clean exit, not a kill

    # A parent that dies without stopping its proxy (os._exit skips the atexit hook): the proxy follows it.
    script = (
        "import os; from fsdp_harness.s3_proxy import start_proxy;"
        f"p = start_proxy({s3_server.endpoint!r}); print(p.process.pid, p.log_path, flush=True); os._exit(0)"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    orphan, log_path = run.stdout.split()
    orphan = int(orphan)
    os.unlink(log_path)  # what the parent's stop() would have removed
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        psutil.Process(orphan).kill()
        pytest.fail("the proxy outlived its parent")


@pytest.mark.timeout(30)
def test_proxy_answers_502_when_the_server_is_gone(s3_proxies):
    proxy = s3_proxies(upstream=f"http://127.0.0.1:{free_loopback_port()}")
    with pytest.raises(botocore.exceptions.ClientError, match=r"\(502\)"):
        boto3_client(proxy.endpoint, attempts=1).head_bucket(Bucket="any")  # HEAD: the code is the status
    assert [(e["op"], e["status"]) for e in proxy.log()] == [("HeadBucket", 502)]


@pytest.mark.parametrize(
    "method, target, headers, expected",
    [
        ("PUT", "/b/k?partNumber=3&uploadId=u", (), "UploadPart"),
        ("PUT", "/b/k?partNumber=3&uploadId=u", ("x-amz-copy-source",), "UploadPartCopy"),
        ("POST", "/b/k?uploads", (), "CreateMultipartUpload"),
        ("POST", "/b/k?uploadId=u", (), "CompleteMultipartUpload"),
        ("DELETE", "/b/k?uploadId=u", (), "AbortMultipartUpload"),
        ("GET", "/b/k?uploadId=u", (), "ListParts"),
        ("GET", "/b?uploads&prefix=k", (), "ListMultipartUploads"),
        ("GET", "/b/k", ("range",), "GetObjectRange"),
        ("GET", "/b/k?X-Amz-Signature=s&X-Amz-Date=d", (), "GetObject"),
        ("HEAD", "/b/k", (), "HeadObject"),
        ("PUT", "/b/k", (), "PutObject"),
        ("GET", "/b?list-type=2&prefix=k", (), "ListObjectsV2"),
        ("GET", "/b?prefix=k&delimiter=%2F", (), "ListObjects"),
        ("POST", "/b?delete", (), "DeleteObjects"),
        ("PUT", "/b", (), "CreateBucket"),
        ("GET", "/b?location", (), "GETBucket?location"),
    ],
)
@pytest.mark.timeout(10)
def test_operation_names(method, target, headers, expected):
    url = urlsplit(target)
    assert operation(method, url.path, parse_qs(url.query, keep_blank_values=True), set(headers)) == expected


@pytest.mark.timeout(10)
def test_each_rank_picks_its_proxy_from_one_shared_environment(monkeypatch):
    env = rank_endpoints_env(["http://127.0.0.1:1001", "http://127.0.0.1:1002"])
    assert env["AWS_ENDPOINT_URL"] == "http://127.0.0.1:1001" and env["AWS_ENDPOINT_URL_S3"] is None
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")  # what a forked rank (or Lightning's launcher) is given
    assert use_rank_endpoint() == os.environ["AWS_ENDPOINT_URL"] == "http://127.0.0.1:1002"
    assert use_rank_endpoint(0) == os.environ["AWS_ENDPOINT_URL"] == "http://127.0.0.1:1001"
