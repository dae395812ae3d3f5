"""Shared fixtures: real broker processes on 127.0.0.1."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.brokerproc import BrokerProcess
from tests.postgres import postgres_url  # noqa: F401
from tests.s3server import aws_env, s3_endpoint, s3_url  # noqa: F401 (shared fixtures)


@pytest.fixture
def broker_proc(tmp_path: Path) -> Iterator[BrokerProcess]:
    """A fresh broker with its own data dir, killed after the test."""
    proc = BrokerProcess(tmp_path / "broker").start()
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="session")
def shared_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """One broker for tests that only create their own uniquely named journals."""
    proc = BrokerProcess(tmp_path_factory.mktemp("shared") / "broker").start()
    try:
        yield proc
    finally:
        proc.kill()


def unavailable(reason: str) -> None:
    """A real part this test needs is missing: skip on a developer's machine, but fail in
    CI (CI=true), where everything the suite needs must be there."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI lacks what this test needs: {reason}")
    pytest.skip(reason, allow_module_level=True)
