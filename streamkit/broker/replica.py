"""A journal as this broker serves it: current spool, registers, fragment index.

Appends to a journal are serialized by `append_lock`, which makes them atomic
and linearizable: one append's bytes are never interleaved with another's.
Readers never take the lock; they read committed bytes below the write head
and wait on `changed()` for more.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

from streamkit.broker.faults import NO_SPACE, JournalFault, StoresUnlisted
from streamkit.broker.index import FragmentIndex
from streamkit.broker.local_disk import on_disk
from streamkit.broker.spool import Spool
from streamkit.broker.stores import FragmentStore
from streamkit.protocol import pb

log = logging.getLogger(__name__)

SPOOL_DIR = "@spool"  # "@" never appears in a journal name, so this never collides


def spool_directory(data_dir: Path, journal: str) -> Path:
    return data_dir / "journals" / journal / SPOOL_DIR


class Replica:
    """State of one journal. Created by `open`, which recovers local spools."""

    def __init__(self, spec: pb.JournalSpec, directory: Path, stores: list[FragmentStore]) -> None:
        self.name = spec.name
        self.spec = spec
        self.directory = directory
        self.stores = stores
        self.index = FragmentIndex()
        self.registers = pb.LabelSet()
        self.append_lock = asyncio.Lock()
        self.spool: Spool
        self.local: dict[int, Spool] = {}  # begin -> spool, the current one included
        self.deleted = False
        self.unavailable: JournalFault | None = None  # why appends are refused, if they are
        self.reads_ended = False  # set at shutdown: read streams finish promptly
        self._changed = asyncio.Event()
        self._on_roll: Callable[[Replica, Spool], None] = lambda r, s: None
        self._refresh_lock = asyncio.Lock()
        # Fragments persisted while a store listing is in flight: the listing may
        # predate them, so they are kept when it lands.
        self._persisted_meanwhile: list[pb.Fragment] | None = None
        self._listing_failed = False
        self._listing_error = ""
        # Until the stores are first listed, the lowest offset whose content this broker
        # knows (its oldest local spool); None once listed. Without spools it knows
        # nothing, not even the write head: the stores may hold the journal's history.
        self.known_from: int | None = 0
        # A listed fragment could not be opened (pruned, or removed by another broker's
        # retention): the index may be out of date, so the stores are listed again at the
        # next tick rather than at the refresh interval (5 min by default).
        self.list_soon = False
        # The head spool's files could not be made at open (a full disk): see _start_spool.
        self._head_unwritten = False

    # --- lifecycle -------------------------------------------------------

    @classmethod
    async def open(
        cls,
        spec: pb.JournalSpec,
        directory: Path,
        stores: list[FragmentStore],
        on_roll: Callable[[Replica, Spool], None],
        *,
        new: bool = False,
    ) -> Replica:
        """Recover spools from `directory`, list the stores, and pick the write head.

        A `new` journal (created while this broker runs) without spools starts at 0
        even if its stores can't be listed yet; any other journal without spools
        waits for a listing before it takes appends (its data dir may be lost)."""
        replica = cls(spec, directory, stores)
        replica._on_roll = on_roll
        try:
            rolled = await on_disk(replica._recover_spools)
            if new and replica.known_from == sys.maxsize:
                replica.known_from = 0
            await replica.refresh()
        except BaseException:
            # Close what was opened: a journal whose open is retried (a full disk, say)
            # must not leak two descriptors per spool at each attempt.
            replica._close_spools()
            raise
        for spool in rolled:
            on_roll(replica, spool)
        return replica

    def _catch_up_with_stores(self) -> None:
        """Move the write head to the stores' end if they hold more than the spools: a lost
        data dir (or a journal's history from elsewhere) must not be written over."""
        if self.index.end <= self.spool.end:
            return
        old = self.spool
        if old.length == 0:
            self._start_spool(self.index.end)  # first: if it fails, nothing changed
            self.local.pop(old.begin, None)
            self.index.remove_local(old.begin)
            old.remove_files()
        else:
            old.seal()
            self._start_spool(self.index.end)
            self._on_roll(self, old)

    def unknown_below(self, offset: int) -> JournalFault | None:
        """Why content at `offset` can't be served (or appended at) yet: it is below what
        this broker knows while its stores have not been listed. (A read there jumped
        over persisted content as if deleted; an append guessed the write head.)"""
        if self.known_from is None or offset >= self.known_from:
            return None
        what = (f"offsets below {self.known_from:,} are" if self.known_from < sys.maxsize
                else "its content and write head are")
        return StoresUnlisted(self.name, f"{what} in its fragment stores, which could not be "
                              f"listed since the broker started ({self._listing_error}); "
                              "retry once the store is reachable")

    def _recover_spools(self) -> list[Spool]:
        """Reopen every spool file; all but the newest were rolled and await persisting."""
        paths = sorted(self.directory.glob("*.spool")) if self.directory.exists() else []
        spools: list[Spool] = []
        try:
            for path in paths:
                spool, commit_log = Spool.recover(self.name, path,
                                                  self.spec.fragment.compression_codec)
                if commit_log.registers is not None:
                    self.registers = commit_log.registers
                spools.append(spool)
        except BaseException:
            for spool in spools:
                spool.close()
            raise
        rolled = []
        for spool in spools[:-1]:
            if spool.length == 0:
                spool.remove_files()
            else:
                self._track_local(spool)
                rolled.append(spool)
        if spools:
            self.spool = spools[-1]
            self._track_local(self.spool)
            self.known_from = min(self.local)
        else:
            self._start_spool(0)
            self.known_from = sys.maxsize
        return rolled

    def _track_local(self, spool: Spool) -> None:
        self.local[spool.begin] = spool
        self.index.add(spool.fragment())

    def _new_spool(self, begin: int) -> Spool:
        return Spool.create(self.name, self.directory, begin,
                            self.spec.fragment.compression_codec, self.registers)

    def _start_spool(self, begin: int) -> None:
        """Make the empty write head at `begin`. On a full disk it is left unwritten (no
        files): reads of what the stores hold go on, and the first append writes it, or
        fails saying the disk is full."""
        try:
            self.spool = self._new_spool(begin)
            self._head_unwritten = False
        except OSError as error:
            if error.errno not in NO_SPACE:
                raise
            if not self._head_unwritten:  # once, not again as it catches up with stores
                log.warning("journal %s: no room for its write head's spool (%s); reads go "
                            "on, appends fail until there is room", self.name, error.strerror)
            self.spool = Spool(journal=self.name, directory=self.directory, begin=begin,
                               codec=self.spec.fragment.compression_codec, end=begin)
            self._head_unwritten = True
        self._track_local(self.spool)

    def write_head_spool(self) -> None:
        """Write the head's spool files if a full disk left them unwritten at open
        (raises the OSError if it still does). Callers hold append_lock."""
        if self._head_unwritten:
            self.spool = self._new_spool(self.spool.begin)
            self._head_unwritten = False
            self._track_local(self.spool)
            log.info("journal %s: its write head's spool is written, now that there is "
                     "room", self.name)

    def _close_spools(self) -> None:
        for spool in self.local.values():
            spool.close()
        spool = getattr(self, "spool", None)
        if spool is not None:
            spool.close()

    async def close(self) -> None:
        """Stop serving (journal deleted or broker stopping); files stay on disk.

        New appends are refused at once; files close only after an append in
        progress (whose commit may still be writing to them) has finished.
        """
        self.deleted = True
        self.notify()
        async with self.append_lock:
            for spool in self.local.values():
                spool.close()

    # --- reads and change notification -----------------------------------

    def end_reads(self) -> None:
        """Make every read stream (blocking ones included) end at its next step."""
        self.reads_ended = True
        self.notify()

    @property
    def write_head(self) -> int:
        return self.spool.end

    def notify(self) -> None:
        """Wake every reader waiting for new content or index changes."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def changed(self) -> asyncio.Event:
        """An event set at the next commit, roll, index change or close."""
        return self._changed

    # --- appends (callers hold append_lock) ------------------------------

    def maybe_roll(self, now: float | None = None) -> bool:
        """Roll the spool if it reached the fragment length or crossed a flush boundary."""
        spool, frag = self.spool, self.spec.fragment
        if spool.length == 0:
            return False
        due = spool.length > frag.length > 0  # Gazette's rule: may overshoot by one append
        flush = frag.flush_interval.ToMilliseconds() if frag.HasField("flush_interval") else 0
        if flush > 0 and spool.first_append_ms:
            now_ms = int((time.time() if now is None else now) * 1000)
            due = due or (spool.first_append_ms // flush != now_ms // flush)
        return due and self.roll()

    def roll(self) -> bool:
        """Close the current spool to appends and start the next at the write head.

        The next spool is made first: if that fails (a full disk), the current
        one goes on taking appends and nothing changed.

        A fenced spool (its file cut short from outside, or a commit that could not be
        undone) is not rolled: it stays as it is, local and refusing appends, for the
        restart's recovery, which keeps its intact prefix. Rolling it would end the fence
        silently (the next spool taking appends) and persist what it lost. Returns whether
        the spool rolled.
        """
        old = self.spool
        old.check_intact()
        if old.fenced:
            return False
        new = self._new_spool(old.end)
        try:
            old.seal()
        except BaseException:  # (SpoolDamaged: cut short just now; fenced by seal)
            new.remove_files()
            raise
        self.spool = new
        self._track_local(new)
        self._on_roll(self, old)
        self.notify()
        return True

    def committed(self, spool: Spool) -> None:
        """Publish a spool's new committed end to readers."""
        self.index.add(spool.fragment())
        self.notify()

    def persisted(self, local: Spool, remote: pb.Fragment) -> None:
        """Swap a persisted spool for its store copy and drop the local files."""
        self.index.add(remote)
        if self._persisted_meanwhile is not None:
            self._persisted_meanwhile.append(remote)
        self.index.remove_local(local.begin)
        self.local.pop(local.begin, None)
        local.remove_files()
        self.notify()

    # --- store listings ---------------------------------------------------

    async def refresh(self) -> None:
        """Re-list every store of the journal into the index."""
        async with self._refresh_lock:
            self._persisted_meanwhile = []
            try:
                listed = await self._list_stores()
                if listed is not None:
                    self.index.replace_remote(listed + self._persisted_meanwhile)
                    self.list_soon = False
            finally:
                self._persisted_meanwhile = None
            if listed is not None and self.known_from is not None:
                async with self.append_lock:  # (appends were refused if the head was unknown)
                    if self.deleted:  # dropped while listing: its files are not ours now
                        return
                    self._catch_up_with_stores()
                    self.known_from = None
        self.notify()

    async def _list_stores(self) -> list[pb.Fragment] | None:
        """The union of the stores' listings, or None if any store failed."""
        listed: list[pb.Fragment] = []
        template = self.spec.fragment.path_postfix_template
        for store in self.stores:
            try:
                # The store keeps only paths the template can produce: a/b's folder
                # also holds a/b/c's.
                listed.extend(await store.list(self.name, template))
            except Exception as err:  # a store outage must not take the journal down
                self._listing_error = f"{store.url}: {err}"
                if not self._listing_failed:  # once per outage, not at every refresh
                    log.warning("listing %s for journal %s failed (retried at each refresh): "
                                "%s", store.url, self.name, err)
                self._listing_failed = True
                return None
        if self._listing_failed:
            log.info("listing the stores of journal %s works again", self.name)
            self._listing_failed = False
        return listed
