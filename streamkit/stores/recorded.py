"""The base of stores whose files are recorded into a recovery log."""

from __future__ import annotations

from collections.abc import Sequence

from streamkit.client.append_service import OpFuture
from streamkit.recoverylog.recorded_fs import RecordedFS
from streamkit.stores.store import Store, StoreError


class RecordedStore(Store):
    """Base of stores whose files live in a RecordedFS (and so in a recovery log).

    Such a store has no fence of its own: the recovery log's `author` register
    is the fence. Once another instance recovered the log, this instance's
    recorder appends fail with RegisterMismatch, which surfaces from the
    OpFuture of its next commit.
    """

    def __init__(self, fs: RecordedFS) -> None:
        self.fs = fs
        self._destroyed = False

    def _check_open(self) -> None:
        if self._destroyed:
            raise StoreError("store was destroyed")

    @staticmethod
    async def _failed_dependency(wait_for: Sequence[OpFuture]) -> BaseException | None:
        """Wait for every dependency; the first one's error, or None if all succeeded.

        Commits of recorded stores happen locally and synchronously, so they
        wait here, before touching any file: a transaction whose appends to
        other journals failed must leave no trace in the store or the log.
        """
        for dependency in wait_for:
            await dependency.wait()
            if (error := dependency.exception()) is not None:
                return error
        return None
