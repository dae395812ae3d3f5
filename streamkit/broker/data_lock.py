"""One broker per data directory.

Two brokers on one data directory would each take the other's spool files
(the journals' unpersisted appends) for their own, persist and delete them
while the other still appends to them: acknowledged appends would be lost.
Nothing else prevents that mistake (a second `streamkit run` of one app, a
backfill starting the app's bundled broker on another port), so a broker
holds a process lock on `DATA_DIR/broker.lock` for its life, taken before it
reads anything there. The lock names the broker's pid and the address a
client on this machine dials, which commands use to find the app's broker.
"""

from __future__ import annotations

from pathlib import Path

from streamkit.process_lock import Held, Holder, ProcessLock, holder

__all__ = ["data_dir_holder", "lock_data_dir"]

_LOCK_FILE = "broker.lock"


def lock_data_dir(data_dir: Path, address: str) -> ProcessLock:
    """The data directory's lock, taken for this process (serving `address`); OSError
    naming the broker that holds it already."""
    lock = ProcessLock(data_dir / _LOCK_FILE)
    try:
        lock.acquire(address)
    except Held as held:
        raise OSError(f"another broker ({held.held_by.describe()}) serves the data directory "
                      f"{data_dir}: two brokers on one data directory would lose each other's "
                      "appends") from None
    return lock


def data_dir_holder(data_dir: Path) -> Holder | None:
    """The broker serving `data_dir` now (its note is the address to dial), if one does."""
    return holder(data_dir / _LOCK_FILE)
