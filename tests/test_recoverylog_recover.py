"""recover(): rebuild a directory from its log and take the log over."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import pytest

from streamkit.client import BrokerClient, RegisterMismatch
from streamkit.recoverylog import CONTENT_TYPE, recovery, rpb
from streamkit.recoverylog.recorded_fs import RecordedFS
from streamkit.recoverylog.recovery import Playback, recover
from tests.brokerproc import BrokerProcess
from tests.helpers_client import create_journal, eventually, unique_name


async def _log_with_state(client: BrokerClient, prefix: str, directory: Path
                          ) -> tuple[str, RecordedFS]:
    """A new recovery log, recovered into `directory`, whose state.json holds {"n": 1}."""
    log = unique_name(prefix)
    await create_journal(client, log, labels={"content-type": CONTENT_TYPE})
    fs = await recover(client, log, directory)
    with fs.open("state.json", "wb") as f:
        f.write(b'{"n": 1}')
    await fs.fsync()
    return log, fs


async def test_recover_rebuilds_and_fences_the_previous_recorder(
    shared_broker: BrokerProcess, tmp_path: Path
) -> None:
    async with BrokerClient(shared_broker.address) as client:
        log, first = await _log_with_state(client, "recover", tmp_path / "first")

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


async def test_a_take_over_held_up_by_a_hung_broker_says_where_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A take-over that keeps playing (here: its broker SIGSTOPped, connections open)
    says every SLOW_TAKE_OVER where playback is, and finishes once the broker is back;
    one cancelled meanwhile stops its playback too (which removes the directory)."""
    monkeypatch.setattr(recovery, "SLOW_TAKE_OVER", 0.2)
    caplog.set_level(logging.WARNING, logger=recovery.__name__)
    broker = BrokerProcess(tmp_path / "broker").start()
    try:
        async with BrokerClient(broker.address) as client:
            log, first = await _log_with_state(client, "slow-take-over", tmp_path / "first")
            await first.recorder.close()

            broker.proc.send_signal(signal.SIGSTOP)
            try:
                abandoned = Playback(client, log, tmp_path / "abandoned")
                abandoning = asyncio.ensure_future(abandoned.take_over())
                taking = asyncio.ensure_future(recover(client, log, tmp_path / "second"))
                await eventually(lambda: caplog.text.count("still playing after") >= 4, 10,
                                 "reports of the slow take-overs")
                abandoning.cancel()
                await eventually(lambda: not (tmp_path / "abandoned").exists(), 10,
                                 "the cancelled playback to clean up")
            finally:
                broker.proc.send_signal(signal.SIGCONT)
            second = await asyncio.wait_for(taking, 30)
            assert (tmp_path / "second" / "state.json").read_bytes() == b'{"n": 1}'
            await second.recorder.close()
            assert f"taking over {log}: still playing after" in caplog.text
            assert "backfill at " in caplog.text  # where: still reading up to the head
    finally:
        broker.kill()
