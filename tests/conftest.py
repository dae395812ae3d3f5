"""Shared fixtures: real broker processes on 127.0.0.1; seeded randomness; a suite that
cannot flake (see tests/waiting.py for polling instead of sleeping, and helper threads)."""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.brokerproc import BrokerProcess
from tests.bytecode import compile_bytecode
from tests.postgres import postgres_url  # noqa: F401
from tests.s3server import aws_env, s3_endpoint, s3_url  # noqa: F401 (shared fixtures)

# Every response a streamkit client channel receives is checked against Gazette's protocol
# rules (streamkit.protocol.conformance), here and in the processes the tests start.
os.environ.setdefault("STREAMKIT_CHECK_RESPONSES", "1")
compile_bytecode()  # for the processes tests start (see tests/bytecode.py)

# `backfill --spark` hands its job to a running `streamkit spark start` driver: never to one
# of the developer's (tests that want one start their own, at a socket of their own).
os.environ["STREAMKIT_SPARK_DRIVER"] = str(
    Path(tempfile.gettempdir(), f"streamkit-tests-{os.getpid()}", "no-driver.sock"))

# --- randomness that can be replayed --------------------------------------------------------

SEED_ENV = "STREAMKIT_TEST_SEED"


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """This test's random seed: $STREAMKIT_TEST_SEED if set (to replay a failure), else a
    fresh one. It is printed, and pytest shows a failed test's output, so that every failure
    names the seed that replays it."""
    chosen = os.environ.get(SEED_ENV)
    value = int(chosen) if chosen else random.SystemRandom().randrange(1 << 32)
    print(
        f"random seed: {SEED_ENV}={value} (replay: {SEED_ENV}={value} pytest "
        f"'{request.node.nodeid}')"
    )
    request.node.user_properties.append(("random_seed", value))
    return value


@pytest.fixture
def rng(seed: int) -> random.Random:
    """The test's random generator, seeded with `seed` (printed)."""
    return random.Random(seed)


# Hypothesis: the same examples on every run (derandomize: a run that passed passes again),
# no per-example time limit (a wall-clock bound that a loaded machine breaks) and no
# too_slow health check (the same); a failure prints its @reproduce_failure blob. To explore
# new examples instead: HYPOTHESIS_PROFILE=explore (failures then also print the blob, and
# Hypothesis' example database replays them).
_NO_CLOCK = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("streamkit", derandomize=True, print_blob=True, **_NO_CLOCK)
settings.register_profile("explore", print_blob=True, **_NO_CLOCK)  # with the example database
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "streamkit"))


def pytest_configure(config: pytest.Config) -> None:
    # An exception that escapes a thread fails the test (pytest only warns by default).
    # Tests start helper threads as tests.waiting.Worker, whose join() re-raises; this is the
    # net under everything else.
    config.addinivalue_line("filterwarnings", "error::pytest.PytestUnhandledThreadExceptionWarning")


# --- brokers -------------------------------------------------------------------------------


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
