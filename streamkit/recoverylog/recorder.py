"""Recorder: turns observed file operations into fenced, batched recovery-log appends.

Operations are recorded *after* they happened locally, so record calls are
synchronous: they sequence the op through the FSM and queue its frame. A
dispatch task sends queued frames in order, one Append RPC per batch, each
checked against the `author=<me>` register so that once a Player hands the
log off to another author, this Recorder's appends fail (REGISTER_MISMATCH)
instead of forking the history. The first non-empty append also sets the
register, which fences whoever held the log before.

A failed append is sticky: every later batch and record call raises it, as
the FSM has already moved past ops the log never got.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
from collections import deque
from collections.abc import Iterable, Iterator

from streamkit.client import BrokerClient, OpFuture
from streamkit.client.appender import append_with_retries
from streamkit.errors import StreamkitError
from streamkit.protocol import pb
from streamkit.protocol import recoverylog_pb2 as rpb
from streamkit.recoverylog.fsm import (
    FSM,
    author_fence,
    author_selector,
    encode_frame,
    new_random_author,
)
from streamkit.tasks import cancel_and_wait

__all__ = ["Recorder", "RecorderClosed", "normalize_path"]

MAX_BATCH = 8 << 20  # a batch this large takes no more groups of ops (one group may exceed it)


class RecorderClosed(StreamkitError, RuntimeError):
    """The Recorder was closed (or its dispatch task stopped) before these ops were appended."""


def normalize_path(path: str) -> str:
    """`path` relative to the recorded root, in the log's form: "/a/b"."""
    clean = posixpath.normpath("/" + path.replace("\\", "/").lstrip("/"))
    if clean.startswith("//") or "/../" in clean + "/":
        raise ValueError(f"path {path!r} leaves the recorded directory")
    return clean


class _Batch:
    """Frames sent as one append once the batches before it have committed."""

    __slots__ = ("dependencies", "future", "parts", "size")

    def __init__(self, dependencies: Iterable[OpFuture]) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.dependencies = [d for d in dependencies if not d.succeeded()]
        self.future = OpFuture()


class Recorder:
    """Records file operations of one directory tree into recovery log `journal`.

    Build it with the FSM a Player recovered (or `FSM(FSMHints(log=...))` for
    a new log), then `await start()`. Paths are relative to the recorded root.
    """

    def __init__(
        self,
        client: BrokerClient,
        journal: str,
        fsm: FSM,
        author: int | None = None,
        *,
        fenced: bool = True,
    ) -> None:
        self.client = client
        self.journal = journal
        self.fsm = fsm
        self.author = author or new_random_author()
        self.write_head = 0  # lower bound of where the next op lands
        self._check = author_selector(self.author) if fenced else None
        self._union: pb.LabelSet | None = author_fence(self.author) if fenced else None
        self._open: _Batch | None = None
        self._queue: deque[_Batch] = deque()
        self._wakeup = asyncio.Event()
        self._error: BaseException | None = None
        self._task: asyncio.Task[None] | None = None
        self._group_depth = 0

    async def start(self, write_head: int | None = None) -> None:
        """Start dispatching, and learn the write head with a (fenced) barrier, unless the
        caller knows it (a Player's hand-off just ended there, fencing everyone else: the
        first append checks the fence, as the barrier would have)."""
        self._task = asyncio.get_running_loop().create_task(self._serve())
        if write_head is None:
            await self.barrier()
        else:
            self.write_head = write_head

    async def close(self, flush: bool = True) -> None:
        """Flush queued ops (raising a failure) and stop the dispatch task.

        Whatever is still queued once the task stopped (close was cancelled, or
        ops were recorded after its flush) fails with RecorderClosed, as does
        every later record call: nobody is left to append them. Without `flush`
        nothing more is appended (not even the flush's fence check): for a
        replica letting go, whose ops past its last commit are as disposable as
        a crash would leave them, and whose broker may be gone.
        """
        try:
            if self._error is None and flush:
                await self.barrier()
        finally:
            if self._task is not None:
                await cancel_and_wait(self._task, f"recording to {self.journal}")
            self._fail(self._error or RecorderClosed(f"recorder of {self.journal} is closed"))

    # --- recording ---------------------------------------------------------

    def record_open(
        self, path: str, *, create: bool = True, truncate: bool = False, exclusive: bool = False
    ) -> int:
        """Record an open of `path` for writing, with os.open's flag semantics; its Fnode."""
        path = normalize_path(path)
        fnode = self.fsm.links.get(path)
        if fnode is None and not create:
            raise FileNotFoundError(f"open of unrecorded {path} without create")
        if fnode is not None and exclusive:
            raise FileExistsError(f"exclusive open of recorded {path}")
        if fnode is None:
            return self._process(rpb.RecordedOp(create=rpb.RecordedOp.Create(path=path)))
        if truncate:  # truncates the file, under every link: as os.open does
            return self.record_replace(fnode, b"")
        return fnode

    def record_create(self, path: str) -> int:
        """Record the creation (or truncation to empty) of `path`; its Fnode."""
        return self.record_open(path, create=True, truncate=True)

    def record_write(self, fnode: int, data: bytes | bytearray | memoryview, offset: int) -> None:
        """Record `data` written at `offset` of `fnode`: one op and its bytes, appended together."""
        data = bytes(data)
        op = rpb.RecordedOp(write=rpb.RecordedOp.Write(fnode=fnode, offset=offset,
                                                       length=len(data)))
        self._process(op, data)

    def record_replace(self, fnode: int, content: bytes) -> int:
        """Record that `fnode`'s content became `content` (a truncate); its new Fnode.

        Gazette's log has no truncate op, so the file is re-created under all
        its links and `content` is written afresh. Truncating to empty (what
        stores do) costs just the re-create. One group: a crash never leaves
        the paths unlinked, or the file empty, in the log.
        """
        node = self.fsm.live_nodes.get(fnode)
        if node is None:
            raise FileNotFoundError(f"fnode {fnode} is not live")
        first, *others = sorted(node.links)
        with self.group():
            for link in [first, *others]:
                self._process(rpb.RecordedOp(unlink=rpb.RecordedOp.Link(fnode=fnode, path=link)))
            new = self._process(rpb.RecordedOp(create=rpb.RecordedOp.Create(path=first)))
            for link in others:
                self._process(rpb.RecordedOp(link=rpb.RecordedOp.Link(fnode=new, path=link)))
            if content:
                self.record_write(new, content, 0)
        return new

    def record_remove(self, path: str) -> None:
        """Record the removal of the link `path`."""
        path = normalize_path(path)
        self._process(rpb.RecordedOp(unlink=rpb.RecordedOp.Link(fnode=self._fnode(path),
                                                                path=path)))

    def record_link(self, src: str, target: str) -> None:
        """Record a new hard link `target` of the file at `src`."""
        src, target = normalize_path(src), normalize_path(target)
        self._process(rpb.RecordedOp(link=rpb.RecordedOp.Link(fnode=self._fnode(src),
                                                              path=target)))

    def record_rename(self, src: str, target: str) -> None:
        """Record a rename: unlink what `target` held, link `target`, unlink `src`.

        One group, so the log never holds `target` unlinked but not re-linked.
        """
        src, target = normalize_path(src), normalize_path(target)
        fnode = self._fnode(src)
        previous = self.fsm.links.get(target)
        if previous == fnode:
            return  # POSIX: renaming a file onto a link of itself changes nothing
        with self.group():
            if previous is not None:
                self._process(rpb.RecordedOp(unlink=rpb.RecordedOp.Link(fnode=previous,
                                                                        path=target)))
            self._process(rpb.RecordedOp(link=rpb.RecordedOp.Link(fnode=fnode, path=target)))
            self._process(rpb.RecordedOp(unlink=rpb.RecordedOp.Link(fnode=fnode, path=src)))

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Ops recorded inside (synchronously: no await) go to the log in one append.

        A full batch is rolled over only where a group starts, never between
        the ops of one, so a crash cannot persist half of a multi-op change.
        Groups nest; a group may make its batch exceed MAX_BATCH.
        """
        if self._group_depth == 0 and self._open is not None and self._open.size >= MAX_BATCH:
            self._open = None
        self._group_depth += 1
        try:
            yield
        finally:
            self._group_depth -= 1

    def fnode_of(self, path: str) -> int | None:
        """The Fnode linked at `path`, if any."""
        return self.fsm.links.get(normalize_path(path))

    def is_live(self, fnode: int) -> bool:
        return fnode in self.fsm.live_nodes

    def _fnode(self, path: str) -> int:
        fnode = self.fsm.links.get(path)
        if fnode is None:
            raise FileNotFoundError(f"{path} is not a recorded file")
        return fnode

    def _process(self, op: rpb.RecordedOp, data: bytes = b"") -> int:
        """Sequence `op` through the FSM and queue its frame (and data); its seq_no."""
        if self._error is not None:
            raise self._error
        op.author = self.author
        op.seq_no = self.fsm.next_seq_no
        op.checksum = self.fsm.next_checksum
        header, payload = encode_frame(op)
        outcome = self.fsm.apply(op, payload, self.journal, self.write_head)
        if not outcome.applied:  # our own FSM: only a bug gets here
            raise RuntimeError(f"recorder FSM did not apply op {op.seq_no}: {outcome}")
        with self.group():  # a lone op is a group of its own
            batch = self._batch(())
        batch.parts += (header, payload, data) if data else (header, payload)
        batch.size += len(header) + len(payload) + len(data)
        return op.seq_no

    # --- appending ---------------------------------------------------------

    def barrier(self, wait_for: Iterable[OpFuture] = ()) -> OpFuture:
        """An OpFuture resolving once every op recorded so far has committed.

        The append it stands for starts only after `wait_for` succeeded (and
        fails with the first of their errors). With nothing queued it is a
        zero-byte append, which still verifies this Recorder's fence.
        """
        wait_for = list(wait_for)
        if self._error is not None:
            return OpFuture.finished(self._error)
        if wait_for:
            self._open = None  # later ops must follow the dependencies too
        return self._batch(wait_for).future

    async def build_hints(self) -> rpb.FSMHints:
        """Hints of the current state, returned once every op they cover has committed."""
        hints = self.fsm.build_hints(self.journal)
        await self.barrier()
        return hints

    def _batch(self, dependencies: Iterable[OpFuture]) -> _Batch:
        """The open batch, or a new one (size limits are `group`'s to apply)."""
        batch = self._open
        if batch is None:
            batch = self._open = _Batch(dependencies)
            self._queue.append(batch)
            self._wakeup.set()
        return batch

    async def _serve(self) -> None:
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self._queue[0]
            try:
                for dependency in batch.dependencies:
                    await dependency
                if self._open is batch:
                    self._open = None  # from here on, new ops go to the next batch
                response = await self._send(batch)
            except Exception as exc:  # sticky: fail this and every later batch
                self._fail(exc)
                return
            except BaseException as exc:  # cancelled (close): nobody will append the rest
                self._fail(RecorderClosed(f"recorder of {self.journal} stopped: {exc!r}"))
                raise
            self._queue.popleft()
            if response.commit.end > self.write_head:
                self.write_head = response.commit.end
            batch.future.resolve(response)

    async def _send(self, batch: _Batch) -> pb.AppendResponse:
        parts = batch.parts
        union = self._union if batch.size else None
        response = await append_with_retries(
            self.client, self.journal, lambda: parts,
            check_registers=self._check, union_registers=union,
        )
        if union is not None:
            self._union = None  # the register is ours now; later appends only check it
        return response

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._open = None
        while self._queue:
            self._queue.popleft().future.fail(error)
