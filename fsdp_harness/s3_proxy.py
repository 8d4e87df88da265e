"""A fault-injecting HTTP reverse proxy between one rank and the S3 server (:mod:`.s3_server`): it counts the bytes
the rank sends to the server and receives from it, per S3 operation, and breaks the requests it is told to.

``python -m fsdp_harness.s3_proxy --upstream http://127.0.0.1:P [--port 0] [--faults JSON] [--port-file F]`` listens
on ``127.0.0.1`` only and prints ``s3 proxy listening on 127.0.0.1:<port>`` once ready (and writes the port to
``F``). It exits on SIGTERM/SIGINT or when its parent dies. From Python, :func:`start_proxy` runs it and returns an
:class:`S3Proxy` handle; give a rank ``S3Proxy.env()`` (:func:`fsdp_harness.s3_server.client_env` of the proxy) and its
clients reach the server through it. One proxy per rank gives per-rank counts and faults.

Forwarding: every request goes to the upstream on a fresh connection (the client's connection is kept alive, the
proxy's to the server is not: simpler, loopback connects cost nothing, and moto's werkzeug server answers
``Connection: close`` anyway), with its headers unchanged (``Host`` included, which the client signed) but for
hop-by-hop ones and ``Expect`` (the proxy answers ``100 Continue`` itself). Bodies stream in 64 KiB pieces both
ways: a ``Content-Length`` body as is, a chunked one re-chunked (aiohttp's and urllib3's streamed uploads;
botocore's ``aws-chunked`` checksum trailers, which it sends over HTTPS only), a chunked response re-chunked, a
response without a length ends the client's connection. ``HEAD``, 1xx, 204 and 304 responses have no body.

Counts (``GET /__proxy__/counts``, :meth:`S3Proxy.counts`): per operation (:func:`operation`), ``requests``,
``sent`` (request-body bytes forwarded to the server, de-chunked), ``payload`` (the object bytes of the requests
forwarded in full: ``x-amz-decoded-content-length`` where the client sent one, else the body's length; over plain
HTTP botocore's bodies are the object's bytes, so ``payload == sent`` but for a reset), ``received`` (response-body
bytes from the server) and ``faults`` (requests this proxy broke); ``total`` sums them. Answers made up by a fault
are not traffic: the server never saw those requests. ``GET /__proxy__/log`` lists every request (operation,
method, path, query, part number, range, checksum algorithm, the server's status, bytes, fault);
``POST /__proxy__/reset`` zeroes counts and log.

Faults (``--faults`` at start, ``POST /__proxy__/faults`` with a JSON list to replace them at run time,
``GET /__proxy__/faults`` to read them with what is left of each): a list of :class:`Fault`. For each request, in
order, a fault whose filter matches (``op``: one operation or a list, ``None`` for any; ``part_numbers``) and that is
not used up either lets it pass while its ``skip`` lasts (counting it down) or fires (counting ``times`` down; ``None``
fires forever) and ends the search. Actions:

- ``reset``: forward ``after_bytes`` bytes of the request body, then reset both connections (``SO_LINGER`` 0: a
  TCP RST), so the client sees ``ECONNRESET`` mid-upload and the server a truncated request. ``after_bytes`` at or
  past the body's end forwards the whole request and resets the client instead of relaying the server's answer:
  the server has done the work, the client does not know it.
- ``error``: read and drop the request body, answer ``status`` with S3's XML error body (``code``, ``message``), none
  for ``HEAD``; the connection stays open. :func:`internal_error` (500), :func:`slow_down` (503 ``SlowDown``),
  :func:`access_denied` (403 ``AccessDenied``).

S3 is addressed path-style (``/bucket/key``), as botocore addresses an IP endpoint; ``/__proxy__/`` cannot be a
bucket (no underscores in bucket names).
"""
import argparse
import collections
import dataclasses
import http.client
import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union
from urllib.parse import parse_qs, urlsplit
from xml.sax.saxutils import escape

from fsdp_harness.s3_server import _STARTED, _stop, client_env, exit_with_parent, spawn_with_port_file, write_port_file

CONTROL = "/__proxy__/"
PIECE = 64 * 1024

#: Headers of one connection, not of the message (RFC 9110 7.6.1), plus ``Expect``, which the proxy answers itself.
#: Content-Length and Transfer-Encoding are set by the proxy for the framing it sends.
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
}

_QUERY_AUTH = {"AWSAccessKeyId", "Signature", "Expires"}
_LIST_OBJECTS_PARAMETERS = {"prefix", "delimiter", "marker", "max-keys", "encoding-type"}

_MESSAGES = {
    "InternalError": "We encountered an internal error. Please try again.",
    "SlowDown": "Please reduce your request rate.",
    "AccessDenied": "Access Denied",
    "ServiceUnavailable": "Service is unable to handle request.",
}


def operation(method: str, path: str, query: Dict[str, List[str]], headers: Any) -> str:
    """The S3 operation of a path-style request: ``UploadPart``, ``CreateMultipartUpload``,
    ``CompleteMultipartUpload``, ``AbortMultipartUpload``, ``ListParts``, ``ListMultipartUploads``, ``PutObject``,
    ``CopyObject``, ``UploadPartCopy``, ``GetObject``, ``GetObjectRange`` (a ``GET`` with ``Range``), ``HeadObject``,
    ``DeleteObject``, ``DeleteObjects``, ``ListObjects``, ``ListObjectsV2``, ``CreateBucket``, ``HeadBucket``,
    ``DeleteBucket``, ``ListBuckets``; else ``<METHOD>Bucket``/``<METHOD>Object`` with the sub-resource, if any."""
    # A presigned URL's signature travels in the query (SigV4's X-Amz-*, SigV2's three): not a sub-resource.
    query = {k: v for k, v in query.items() if not k.lower().startswith("x-amz-") and k not in _QUERY_AUTH}
    bucket, _, key = path.lstrip("/").partition("/")
    if not bucket:
        return "ListBuckets" if method == "GET" else f"{method}Service"
    if not key:
        if method == "GET" and "uploads" in query:
            return "ListMultipartUploads"
        if method == "GET" and query.get("list-type") == ["2"]:
            return "ListObjectsV2"
        if method == "POST" and "delete" in query:
            return "DeleteObjects"
        if method == "GET" and set(query) <= _LIST_OBJECTS_PARAMETERS:
            return "ListObjects"
        if query:
            return f"{method}Bucket?{sorted(query)[0]}"
        return {"GET": "ListObjects", "PUT": "CreateBucket", "HEAD": "HeadBucket", "DELETE": "DeleteBucket"}.get(
            method, f"{method}Bucket"
        )
    copy = "x-amz-copy-source" in headers
    if method == "PUT" and "partNumber" in query and "uploadId" in query:
        return "UploadPartCopy" if copy else "UploadPart"
    if method == "POST" and "uploads" in query:
        return "CreateMultipartUpload"
    if "uploadId" in query:
        return {"POST": "CompleteMultipartUpload", "DELETE": "AbortMultipartUpload", "GET": "ListParts"}.get(
            method, f"{method}Object?uploadId"
        )
    if query and method != "GET":
        return f"{method}Object?{sorted(query)[0]}"
    if method == "PUT":
        return "CopyObject" if copy else "PutObject"
    if method == "GET" and query and "partNumber" not in query:
        return f"GETObject?{sorted(query)[0]}"
    if method == "GET":
        return "GetObjectRange" if "range" in headers else "GetObject"
    return {"HEAD": "HeadObject", "DELETE": "DeleteObject"}.get(method, f"{method}Object")


@dataclasses.dataclass
class Fault:
    """One fault of the proxy (see the module's docstring); JSON-able with :func:`dataclasses.asdict`."""

    action: str  # "reset" or "error"
    op: Union[None, str, List[str]] = "UploadPart"  # the operations it applies to (operation()); None: all
    part_numbers: Optional[List[int]] = None  # only these parts (the partNumber query); None: any request
    skip: int = 0  # matching requests let through before it fires (nth = skip + 1)
    times: Optional[int] = 1  # how often it fires; None: every time
    after_bytes: int = 0  # reset: request-body bytes forwarded first
    status: int = 500  # error: the HTTP status ...
    code: str = "InternalError"  # ... S3's error code ...
    message: Optional[str] = None  # ... and message (None: S3's usual one for the code)
    fired: int = 0  # how often it fired (the proxy counts)

    def __post_init__(self) -> None:
        if self.action not in ("reset", "error"):
            raise ValueError(f"unknown fault action {self.action!r}: 'reset' or 'error'")

    def matches(self, op: str, part_number: Optional[int]) -> bool:
        ops = [self.op] if isinstance(self.op, str) else self.op
        if ops is not None and op not in ops:
            return False
        if self.part_numbers is not None and part_number not in self.part_numbers:
            return False
        return self.times is None or self.times > 0


def reset_part(after_bytes: int, nth: int = 1, part_numbers: Optional[Sequence[int]] = None, times: int = 1) -> Fault:
    """Reset the connection after forwarding ``after_bytes`` of the ``nth`` matching ``UploadPart``'s body."""
    parts = list(part_numbers) if part_numbers is not None else None
    return Fault("reset", "UploadPart", parts, skip=nth - 1, times=times, after_bytes=after_bytes)


def internal_error(
    op: Union[None, str, List[str]] = "UploadPart",
    part_numbers: Optional[Sequence[int]] = None,
    times: Optional[int] = None,
) -> Fault:
    """HTTP 500 ``InternalError`` for ``op`` (by default every ``UploadPart``, forever)."""
    parts = list(part_numbers) if part_numbers is not None else None
    return Fault("error", op, parts, times=times, status=500, code="InternalError")


def slow_down(times: int, op: Union[None, str, List[str]] = "UploadPart") -> Fault:
    """HTTP 503 ``SlowDown`` for the next ``times`` requests of ``op`` (``None``: any), then they pass."""
    return Fault("error", op, times=times, status=503, code="SlowDown")


def access_denied(op: Union[None, str, List[str]] = None, times: Optional[int] = None) -> Fault:
    """HTTP 403 ``AccessDenied`` for ``op`` (by default every request, forever)."""
    return Fault("error", op, times=times, status=403, code="AccessDenied")


def _fault(value: Union[Fault, Dict[str, Any]]) -> Fault:
    return value if isinstance(value, Fault) else Fault(**value)


class _State:
    """What the handler threads share: the upstream, the faults, the counts and the log (under one lock)."""

    def __init__(self, upstream: str, faults: List[Fault], verbose: bool) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--upstream must be http://host:port, not {upstream!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.lock = threading.Lock()
        self.faults, self.verbose = faults, verbose
        self.reset()

    def reset(self) -> None:
        self.counts: Dict[str, Dict[str, int]] = collections.defaultdict(
            lambda: dict(requests=0, sent=0, payload=0, received=0, faults=0)
        )
        self.log: List[Dict[str, Any]] = []

    def take_fault(self, op: str, part_number: Optional[int]) -> Optional[Fault]:
        with self.lock:
            for fault in self.faults:
                if not fault.matches(op, part_number):
                    continue
                if fault.skip > 0:
                    fault.skip -= 1
                    continue
                if fault.times is not None:
                    fault.times -= 1
                fault.fired += 1
                return dataclasses.replace(fault)
        return None

    def record(self, entry: Dict[str, Any]) -> None:
        """Count ``entry`` once. The handler calls it before the last byte of its answer leaves (see
        ``_Handler._recorded``): a client that got its answer finds it in the counts and the log."""
        if entry.get("recorded"):
            return
        entry["recorded"] = True
        with self.lock:
            counts = self.counts[entry["op"]]
            counts["requests"] += 1
            counts["sent"] += entry["sent"]
            counts["payload"] += entry["payload"]
            counts["received"] += entry["received"]
            counts["faults"] += entry["fault"] is not None
            self.log.append(entry)

    def snapshot(self) -> Dict[str, Any]:
        with self.lock:
            by_op = {op: dict(c) for op, c in self.counts.items()}
        total = {k: sum(c[k] for c in by_op.values()) for k in ("requests", "sent", "payload", "received", "faults")}
        return {"by_op": by_op, "total": total}


def _checksum(headers: "set[str]") -> Optional[str]:
    """The algorithm of the request's ``x-amz-checksum-<algorithm>`` header (``crc32``, ...), if it has one: whether
    botocore's ``AWS_REQUEST_CHECKSUM_CALCULATION`` applied. (Over plain HTTP botocore puts the checksum in a header,
    never in an ``aws-chunked`` trailer.)"""
    names = sorted(h[len("x-amz-checksum-") :] for h in headers if h.startswith("x-amz-checksum-"))
    names = [name for name in names if name not in ("mode", "type", "algorithm")]
    return names[0] if names else None


class _Reset(Exception):
    """The request was answered by resetting the client's connection."""


def _abort(sock: Optional[socket.socket]) -> None:
    """Close ``sock`` with a TCP RST (``SO_LINGER`` on, 0 s) instead of an orderly FIN."""
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive with the client, as S3 does
    server: "_Server"

    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_OPTIONS = do_PATCH = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.state.verbose:
            super().log_message(format, *args)

    # -- the request's body --------------------------------------------------------------------------------------

    def _body(self) -> Iterator[bytes]:
        """The request body in pieces, de-chunked; sets ``self._trailers`` (raw trailer lines) for a chunked one."""
        self._trailers = b""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                size = int(self.rfile.readline(65537).split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    break
                while size:
                    piece = self.rfile.read(min(size, PIECE))
                    if not piece:
                        raise ConnectionError("the client closed the connection inside a chunk")
                    size -= len(piece)
                    yield piece
                self.rfile.readline(65537)  # the chunk's CRLF
            while True:
                line = self.rfile.readline(65537)
                if line in (b"\r\n", b"\n", b""):
                    break
                self._trailers += line
            return
        left = int(self.headers.get("Content-Length") or 0)
        while left:
            piece = self.rfile.read(min(left, PIECE))
            if not piece:
                raise ConnectionError("the client closed the connection inside the body")
            left -= len(piece)
            yield piece

    # -- one request ---------------------------------------------------------------------------------------------

    def _handle(self) -> None:
        url = urlsplit(self.path)
        if url.path.startswith(CONTROL):
            return self._control(url.path[len(CONTROL) :])
        query = parse_qs(url.query, keep_blank_values=True)
        headers = {k.lower() for k in self.headers.keys()}
        op = operation(self.command, url.path, query, headers)
        part = query.get("partNumber", [None])[0]
        part_number = int(part) if part and part.isdigit() else None
        entry: Dict[str, Any] = dict(
            op=op, method=self.command, path=url.path, query=url.query, part_number=part_number,
            range=self.headers.get("Range"), checksum=_checksum(headers), status=None, sent=0, payload=0,
            received=0, fault=None,
        )  # fmt: skip
        fault = self.server.state.take_fault(op, part_number)
        try:
            if fault is None:
                self._forward(entry, None)
            elif fault.action == "reset":
                entry["fault"] = f"reset after {fault.after_bytes} bytes"
                self._forward(entry, fault.after_bytes)
            else:
                entry["fault"] = f"error {fault.status} {fault.code}"
                for _ in self._body():  # read, never forwarded: the server does not see the request
                    pass
                entry["status"] = fault.status
                self.server.state.record(entry)
                self._send_error(fault)
        except _Reset:
            self.close_connection = True
        finally:
            self.server.state.record(entry)

    def _send_error(self, fault: Fault) -> None:
        message = fault.message or _MESSAGES.get(fault.code, fault.code)
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{escape(fault.code)}</Code><Message>{escape(message)}</Message>"
            f"<Resource>{escape(urlsplit(self.path).path)}</Resource><RequestId>s3-proxy-fault</RequestId></Error>"
        ).encode()
        self.send_response_only(fault.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-amz-request-id", "s3-proxy-fault")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(self, entry: Dict[str, Any], reset_after: Optional[int]) -> None:
        state = self.server.state
        chunked = "chunked" in self.headers.get("Transfer-Encoding", "").lower()
        upstream = http.client.HTTPConnection(state.host, state.port, timeout=300)
        try:
            upstream.connect()
        except OSError as err:
            # The server is gone: say so (a silently dropped connection would read as a fault of ours).
            for _ in self._body():
                pass
            entry["status"] = 502
            state.record(entry)
            return self._send_error(Fault("error", status=502, code="BadGateway", message=f"upstream: {err}"))
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in _HOP_BY_HOP and not (chunked and name.lower() == "content-length"):
                    upstream.putheader(name, value)
            if chunked:
                upstream.putheader("Transfer-Encoding", "chunked")
            upstream.endheaders()
            for piece in self._body():
                if reset_after is not None and entry["sent"] + len(piece) > reset_after:
                    piece = piece[: reset_after - entry["sent"]]
                    self._send_piece(upstream, piece, chunked)
                    entry["sent"] += len(piece)
                    _abort(upstream.sock)
                    state.record(entry)
                    self._reset_client()
                self._send_piece(upstream, piece, chunked)
                entry["sent"] += len(piece)
            if chunked:
                upstream.send(b"0\r\n" + self._trailers + b"\r\n")
            declared = self.headers.get("x-amz-decoded-content-length")
            entry["payload"] = int(declared) if declared and declared.isdigit() else entry["sent"]
            response = upstream.getresponse()
            entry["status"] = response.status
            if reset_after is not None:
                # The whole request reached the server: let it finish, then keep its answer from the client.
                entry["received"] = len(response.read())
                state.record(entry)
                self._reset_client()
            self._relay(response, entry)
        finally:
            upstream.close()

    @staticmethod
    def _send_piece(upstream: http.client.HTTPConnection, piece: bytes, chunked: bool) -> None:
        if piece:
            upstream.send(b"%x\r\n%b\r\n" % (len(piece), piece) if chunked else piece)

    def _reset_client(self) -> None:
        # The buffered reader and writer hold references to the socket: close them first, or close() would wait.
        for stream in (self.rfile, self.wfile):
            try:
                stream.close()
            except OSError:
                pass
        _abort(self.connection)
        # What the server machinery flushes and closes after the handler: harmless stand-ins for the closed streams.
        self.rfile, self.wfile = io.BytesIO(), io.BytesIO()
        raise _Reset()

    def _relay(self, response: http.client.HTTPResponse, entry: Dict[str, Any]) -> None:
        no_body = self.command == "HEAD" or response.status in (204, 304) or response.status < 200
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        if no_body:
            self.server.state.record(entry)
            self.end_headers()
            return
        if response.chunked:
            self.send_header("Transfer-Encoding", "chunked")
        elif response.length is None:
            self.send_header("Connection", "close")  # the body ends where the connection does
            self.close_connection = True
        # each piece is written once the next one is read, so that the entry is recorded before the last one leaves
        held = b""
        headers_sent = False
        while True:
            piece = response.read1(PIECE) if response.chunked else response.read(PIECE)
            if not piece:
                break
            entry["received"] += len(piece)
            if not headers_sent:
                self.end_headers()
                headers_sent = True
            if held:
                self.wfile.write(b"%x\r\n%b\r\n" % (len(held), held) if response.chunked else held)
            held = piece
        self.server.state.record(entry)
        if not headers_sent:
            self.end_headers()
        if held:
            self.wfile.write(b"%x\r\n%b\r\n" % (len(held), held) if response.chunked else held)
        if response.chunked:
            self.wfile.write(b"0\r\n\r\n")

    # -- the control endpoint ------------------------------------------------------------------------------------

    def _control(self, what: str) -> None:
        state = self.server.state
        body = b"".join(self._body())
        if self.command == "GET" and what == "counts":
            answer: Any = state.snapshot()
        elif self.command == "GET" and what == "log":
            with state.lock:
                answer = list(state.log)
        elif what == "faults" and self.command in ("GET", "POST"):
            if self.command == "POST":
                try:
                    faults = [_fault(f) for f in json.loads(body or b"[]")]
                except (TypeError, ValueError) as err:
                    return self._json(400, {"error": str(err)})
                with state.lock:
                    state.faults = faults
            with state.lock:
                answer = [dataclasses.asdict(f) for f in state.faults]
        elif self.command == "POST" and what == "reset":
            with state.lock:
                state.reset()
            answer = {}
        else:
            return self._json(404, {"error": f"{self.command} {CONTROL}{what}: no such control"})
        self._json(200, answer)

    def _json(self, status: int, answer: Any) -> None:
        body = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Many ranks' parts at once: a deeper accept queue than socketserver's 5.
    request_queue_size = 128

    def __init__(self, port: int, state: _State) -> None:
        self.state = state
        super().__init__(("127.0.0.1", port), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that went away mid-request (a test's reset, a killed rank) is not worth a traceback.
        if not isinstance(sys.exc_info()[1], (ConnectionError, BrokenPipeError, TimeoutError)):
            super().handle_error(request, client_address)


class S3Proxy:
    """A running proxy process (:func:`start_proxy`); a context manager that stops it."""

    def __init__(self, process: subprocess.Popen, port: int, upstream: str, log_path: Path) -> None:
        self.process, self.port, self.upstream, self.log_path = process, port, upstream, log_path

    @classmethod
    def at(cls, endpoint: str) -> "S3Proxy":
        """The proxy at ``endpoint``, from a process that did not start it (a rank reading its own proxy's counts or
        setting its faults): its counts, log and faults, not :meth:`stop`."""
        return cls(None, int(endpoint.rsplit(":", 1)[1]), "", Path())

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **options: Any) -> Dict[str, Optional[str]]:
        """:func:`fsdp_harness.s3_server.client_env` of this proxy (``options``: ``checksums``, ``max_attempts``)."""
        return client_env(self.endpoint, **options)

    def _call(self, method: str, what: str, payload: Any = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(f"{self.endpoint}{CONTROL}{what}", data=data, method=method)
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10) as answer:
            return json.loads(answer.read())

    def counts(self) -> Dict[str, Any]:
        """``{"by_op": {op: {requests, sent, payload, received, faults}}, "total": {...}}``."""
        return self._call("GET", "counts")

    def log(self) -> List[Dict[str, Any]]:
        """Every request since the start or the last :meth:`reset`, in the order they ended."""
        return self._call("GET", "log")

    def set_faults(self, faults: Sequence[Union[Fault, Dict[str, Any]]]) -> List[Dict[str, Any]]:
        """Replace the faults (``[]``: none); returns them as the proxy holds them."""
        return self._call("POST", "faults", [dataclasses.asdict(_fault(f)) for f in faults])

    def faults(self) -> List[Dict[str, Any]]:
        """The faults with what is left of them (``skip``, ``times``) and how often each ``fired``."""
        return self._call("GET", "faults")

    def reset(self) -> None:
        """Zero the counts and the log."""
        self._call("POST", "reset", {})

    def output(self) -> str:
        """What the proxy process printed (errors; every request with ``verbose``); gone after :meth:`stop`."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` s; then removes its output. Idempotent."""
        _stop(self.process, timeout)
        _STARTED.discard(self.process)
        self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> "S3Proxy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_proxy(
    upstream: str, faults: Sequence[Union[Fault, Dict[str, Any]]] = (), timeout: float = 30.0, verbose: bool = False
) -> S3Proxy:
    """Start a proxy process in front of ``upstream`` (the server's endpoint) with ``faults``."""
    specs = json.dumps([dataclasses.asdict(_fault(f)) for f in faults])
    args = ["--upstream", upstream, "--port", "0", "--faults", specs]
    if verbose:
        args.append("--verbose")
    log_path = Path(tempfile.mkstemp(prefix="s3-proxy-", suffix=".log")[1])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process, port = spawn_with_port_file(__name__, args, env, timeout, log_path, "the S3 proxy")
    return S3Proxy(process, port, upstream, log_path)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, help="the server, http://127.0.0.1:PORT")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--faults", default="[]", help="a JSON list of faults (the fields of Fault)")
    parser.add_argument("--port-file", help="where to write the port once listening")
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    options = parser.parse_args(argv)
    faults = [_fault(f) for f in json.loads(options.faults)]
    server = _Server(options.port, _State(options.upstream, faults, options.verbose))
    port = server.server_address[1]
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    exit_with_parent(done.set)
    # A short poll: shutdown() waits for it, and a test stops a proxy per rank.
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="s3-proxy", daemon=True)
    thread.start()
    if options.port_file:
        write_port_file(options.port_file, port)
    print(f"s3 proxy listening on 127.0.0.1:{port} for {options.upstream}", flush=True)
    while not done.wait(1.0):
        pass
    server.shutdown()
    server.server_close()


if __name__ == "__main__":
    main()
