"""Pytest fixtures of the S3 harness (:mod:`fsdp_harness.s3_server`, :mod:`fsdp_harness.s3_proxy`): a moto server
process per xdist worker, a fresh bucket per test, and fault-injecting proxies, one per rank.

A test module loads them with ``pytest_plugins = ["tests.helpers.s3"]`` (importing the fixtures by name instead
would make ruff's F811 flag every test that takes one as an argument).

- ``s3_server``: the session's :class:`~fsdp_harness.s3_server.S3Server`, S3's 5 MiB minimum part.
- ``s3_servers(min_part_size=...)``: a server with another minimum part size (moto's ``S3_UPLOAD_PART_MIN_SIZE``),
  started on first use and kept for the session, one per size.
- ``s3_bucket``: a new bucket on ``s3_server``, emptied and deleted after the test (the server keeps objects in
  memory for the whole session).
- ``s3_proxies(faults=(), upstream=None)``: a new :class:`~fsdp_harness.s3_proxy.S3Proxy` in front of ``s3_server``
  (or ``upstream``, a server or an endpoint), stopped after the test; call it once per rank. ``proxy.env()`` is the
  environment a rank process needs (merge it with :func:`~fsdp_harness.s3_server.apply_env`);
  :func:`~fsdp_harness.s3_server.rank_endpoints_env` gives ranks that share one environment (the forked ranks of
  ``fsdp_harness/runner.py``) each its own proxy.
- ``s3_env``: this process's own environment pointed at ``s3_server`` (through ``monkeypatch``), for a test's
  in-process clients that configure themselves as the code under test does.

Every process the fixtures start is stopped at teardown, also when the test fails; the processes also exit by
themselves when the test run dies.
"""
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import pytest

from fsdp_harness.s3_proxy import Fault, S3Proxy, start_proxy
from fsdp_harness.s3_server import S3_MIN_PART_SIZE, S3Server, make_bucket, remove_bucket, start_s3_server


@pytest.fixture(scope="session")
def s3_servers() -> Iterator[Callable[..., S3Server]]:
    servers: Dict[int, S3Server] = {}

    def get(min_part_size: int = S3_MIN_PART_SIZE) -> S3Server:
        if min_part_size not in servers or not servers[min_part_size].alive():
            servers[min_part_size] = start_s3_server(min_part_size=min_part_size)
        return servers[min_part_size]

    yield get
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="session")
def s3_server(s3_servers: Callable[..., S3Server]) -> S3Server:
    return s3_servers()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    name = make_bucket(s3_server.endpoint)
    yield name
    remove_bucket(s3_server.endpoint, name)


@pytest.fixture
def s3_proxies(s3_server: S3Server) -> Iterator[Callable[..., S3Proxy]]:
    started: List[S3Proxy] = []

    def start(faults: Sequence[Fault] = (), upstream: Union[S3Server, str, None] = None, **options: Any) -> S3Proxy:
        upstream = upstream or s3_server
        started.append(start_proxy(upstream if isinstance(upstream, str) else upstream.endpoint, faults, **options))
        return started[-1]

    yield start
    for proxy in started:
        proxy.stop()


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Dict[str, Optional[str]]:
    env = s3_server.env()
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    return env
