"""recover(): rebuild a directory from its log and take the log over."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamkit.client import BrokerClient, RegisterMismatch
from streamkit.recoverylog import CONTENT_TYPE, rpb
from streamkit.recoverylog.recovery import recover
from tests.brokerproc import BrokerProcess
from tests.helpers_client import create_journal, unique_name


async def test_recover_rebuilds_and_fences_the_previous_recorder(
    shared_broker: BrokerProcess, tmp_path: Path
) -> None:
    async with BrokerClient(shared_broker.address) as client:
        log = unique_name("recover")
        await create_journal(client, log, labels={"content-type": CONTENT_TYPE})
        first = await recover(client, log, tmp_path / "first")
        with first.open("state.json", "wb") as f:
            f.write(b'{"n": 1}')
        await first.fsync()

        second = await recover(client, log, tmp_path / "second")
        assert (tmp_path / "second" / "state.json").read_bytes() == b'{"n": 1}'
        with first.open("state.json", "wb") as f:
            f.write(b'{"n": "zombie"}')
        with pytest.raises(RegisterMismatch):
            await first.fsync()
        with second.open("state.json", "wb") as f:
            f.write(b'{"n": 2}')
        await second.fsync()
        await second.recorder.close()

        third = await recover(client, log, tmp_path / "third")
        assert (tmp_path / "third" / "state.json").read_bytes() == b'{"n": 2}'
        await third.recorder.close()


async def test_recover_refuses_hints_of_another_log(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="hints are of log"):
        await recover(None, "a/log", tmp_path, rpb.FSMHints(log="another/log"))  # type: ignore[arg-type]
