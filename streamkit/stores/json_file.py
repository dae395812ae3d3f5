"""JSONFileStore: shard state kept in memory, rewritten as one recorded JSON file per commit.

The application mutates `store.state` freely during a consumer transaction.
At commit the store serializes the state together with the Checkpoint into
one document, writes it to a temporary file and renames that over the state
file. The rename is atomic, so a reader of the directory (and a playback of
the recovery log, which records the rename as link/unlink ops) sees either
the previous commit's file or this one's, never a torn mix.

Durability is the recovery log's: the OpFuture `start_commit` returns is a
recorder barrier, resolved once every op of the commit reached the log.

A committed view (for queries beside the open transaction) reads the document
of the last durable commit when the view began, kept as its bytes: `store.state`
in a view is that document decoded on the view's first read, the view's own copy
(a commit meanwhile doesn't change it, and a query changing it changes nothing
else).

`RecordedStore`, the part this store shares with SQLiteStore, also lives
here: waiting for a transaction's dependencies before anything is written.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import AsyncIterator, Sequence
from contextvars import ContextVar
from typing import Any

from google.protobuf import json_format
from pydantic import BaseModel

from streamkit.client.append_service import OpFuture
from streamkit.protocol import consumer_pb
from streamkit.recoverylog.recorded_fs import RecordedFS
from streamkit.stores.recorded import RecordedStore
from streamkit.stores.store import VIEWING, StoreError, viewing

__all__ = ["JSONFileStore"]

_UNDECODED = object()
# The committed view the current task reads in: [the document it pinned, its state once
# decoded] (one list per view: a query's own copy).
_VIEW: ContextVar[list[Any] | None] = ContextVar("streamkit_json_view", default=None)


class JSONFileStore(RecordedStore):
    """Shard state as one JSON document (`path` in `fs`), rewritten at every commit.

    `state` is a pydantic model instance or any JSON-serializable value. The
    application reads and mutates `store.state`; `restore_checkpoint`
    replaces it with the recovered state, of the same type (a model is
    re-validated from the file).

    `start_commit` returns once the transaction's dependencies resolved and
    the file was rewritten locally; the returned OpFuture resolves once the
    rewrite committed to the recovery log.
    """

    def __init__(self, fs: RecordedFS, state: Any, path: str = "state.json") -> None:
        super().__init__(fs)
        self.state = state
        self.path = path
        # Kept apart from `state`, which the application mutates: a restore of a
        # never-committed shard must not start from an earlier assignment's work.
        self._initial = copy.deepcopy(state)
        self._model: type[BaseModel] | None = type(state) if isinstance(state, BaseModel) else None
        self._durable: bytes | None = None  # the last durable commit's document (None: none)

    @property
    def state(self) -> Any:
        """The open transaction's state; in a committed view, the last durable commit's."""
        if VIEWING.get() is not self:
            return self._state
        view = _VIEW.get()
        assert view is not None  # (set with VIEWING by committed_view)
        if view[1] is _UNDECODED:
            document = view[0]
            view[1] = (copy.deepcopy(self._initial) if document is None
                       else self._decode(document, consumer_pb.Checkpoint()))
        return view[1]

    @state.setter
    def state(self, value: Any) -> None:
        if VIEWING.get() is self:
            raise StoreError("a committed view is read-only (queries can't write)")
        self._state = value

    @contextlib.asynccontextmanager
    async def committed_view(self) -> AsyncIterator[None]:  # type: ignore[override]
        """Within it, this task's `state` is the last durable commit's (see the module doc)."""
        self._check_open()
        pinned = _VIEW.set([self._durable, _UNDECODED])  # [document, its state once read]
        try:
            with viewing(self):
                yield
        finally:
            _VIEW.reset(pinned)

    async def restore_checkpoint(self, shard_id: str) -> consumer_pb.Checkpoint:
        self._check_open()
        checkpoint = consumer_pb.Checkpoint()
        self._durable = None
        if not self.fs.exists(self.path):
            self.state = copy.deepcopy(self._initial)  # a shard never committed
            return checkpoint
        with self.fs.open(self.path, "rb") as f:
            document = f.read()
        try:
            self.state = self._decode(document, checkpoint)
        except (KeyError, ValueError, json_format.ParseError) as error:
            raise StoreError(f"shard {shard_id}: bad state file {self.path}: {error}") from error
        self._durable = document
        return checkpoint

    async def start_commit(
        self,
        shard_id: str,
        checkpoint: consumer_pb.Checkpoint,
        wait_for: Sequence[OpFuture],
    ) -> OpFuture:
        self._check_open()
        # Serialized before waiting, so the commit holds exactly this transaction's state.
        content = self._encode(checkpoint)
        if (error := await self._failed_dependency(wait_for)) is not None:
            return OpFuture.finished(error)
        self._check_open()  # destroyed while waiting: write nothing
        temp = f"{self.path}.next"
        try:
            with self.fs.open(temp, "wb") as f:
                f.write(content)
            self.fs.rename(temp, self.path)
        except Exception as error:  # e.g. the recorder already failed
            return OpFuture.finished(error)
        durable = self.fs.fsync()
        durable.on_success(lambda _: self._now_durable(content))
        return durable

    async def destroy(self) -> None:
        """Nothing to release: the files belong to the RecordedFS's directory."""
        self._destroyed = True

    def _now_durable(self, document: bytes) -> None:
        self._durable = document

    def _decode(self, document: bytes, checkpoint: consumer_pb.Checkpoint) -> Any:
        """The state of a document; its checkpoint is parsed into `checkpoint`."""
        parsed = json.loads(document)
        json_format.ParseDict(parsed["checkpoint"], checkpoint)
        state = parsed["state"]
        return self._model.model_validate(state) if self._model else state

    def _encode(self, checkpoint: consumer_pb.Checkpoint) -> bytes:
        state = self.state.model_dump(mode="json") if self._model else self.state
        document = {
            "state": state,
            "checkpoint": json_format.MessageToDict(checkpoint, preserving_proto_field_name=True),
        }
        return json.dumps(document, separators=(",", ":")).encode()
