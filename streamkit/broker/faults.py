"""Faults of one journal: what went wrong, and the status each front end answers.

A fault fails the one operation that met it, never the broker: the gRPC
service aborts the RPC with `grpc_code`, the HTTP gateway answers
`http_status`, and both say which journal and why. The journal serves the
next request as well as it can (an append after a full disk works again
once there is space).

A failure of the KeySpace, where journal specs are kept, is no journal's: it
fails the one change (an Apply) with a status naming the cause, and the broker
serves on with the specs it has.
"""

from __future__ import annotations

import errno
import sqlite3

import grpc

from streamkit.errors import StreamkitError, causes
from streamkit.protocol.codecs import CodecError

__all__ = [
    "ContentLost",
    "JournalFault",
    "JournalUnavailable",
    "KeySpaceFailed",
    "KeySpaceFull",
    "StorageExhausted",
    "StorageFailed",
    "StoreGone",
    "StoresUnlisted",
    "keyspace_fault",
    "storage_fault",
]

# Out of space: the device is full, the file may not grow (RLIMIT_FSIZE), a quota.
NO_SPACE = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
_ETCD_NO_SPACE = "database space exceeded"  # etcd's error when its space quota is spent


class JournalFault(StreamkitError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503

    def __init__(self, journal: str, message: str) -> None:
        super().__init__(f"journal {journal}: {message}")
        self.journal = journal


class StorageExhausted(JournalFault):
    """The broker's disk has no room for an append; it was rolled back."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 507


class StorageFailed(JournalFault):
    """The broker's disk failed an operation (I/O error, read-only file system, ...)."""


class JournalUnavailable(JournalFault):
    """The journal's spec can't be served here (an unopenable store, a damaged spool)."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class StoresUnlisted(JournalFault):
    """The journal's stores have not been listed since the broker started: what they hold
    (below the local spools, or at all) is unknown, so a read there or the write head
    would be guessed. UNAVAILABLE: clients retry, and it passes once a listing works."""


class StoreGone(JournalFault):
    """A listed fragment's store was taken out of the journal's spec since the listing.
    UNAVAILABLE: the next listing drops the fragment from the index."""


class ContentLost(JournalFault):
    """Committed content can't be read back: a read ends with this instead of spinning."""

    grpc_code = grpc.StatusCode.DATA_LOSS
    http_status = 500


def storage_fault(journal: str, doing: str, error: Exception) -> JournalFault:
    """The fault for an OSError (or a store's error) met while `doing` something.

    Stored bytes that can't be decoded for their codec (a CodecError, an OSError too) are
    lost content, not a failing disk or store: ContentLost, which readers don't retry
    (the same bytes fail the same way), never a StorageFailed, which they retry for ever.
    """
    if isinstance(error, CodecError):
        return ContentLost(journal, f"{doing} failed: its content can't be decoded: {error}")
    reason = getattr(error, "strerror", None) or str(error)
    if getattr(error, "errno", None) in NO_SPACE:
        return StorageExhausted(
            journal, f"{doing} failed: {reason} (the broker's disk is full or the file may "
                     "not grow); rolled back, appends work again once there is room")
    return StorageFailed(journal, f"{doing} failed: {reason}")


class KeySpaceFailed(StreamkitError):
    """The KeySpace (where journal specs are kept) failed a change: it is out of reach,
    locked, failing. Not a journal's fault, nor the broker's: the RPC ends UNAVAILABLE,
    naming the cause, and the broker serves on with the specs it has."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


class KeySpaceFull(KeySpaceFailed):
    """The KeySpace has no room for a change (its disk is full, etcd's quota is spent);
    the change was rolled back, and goes through once there is room."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


def keyspace_fault(doing: str, error: BaseException) -> KeySpaceFailed:
    """The fault for a KeySpaceError met while `doing` something."""
    if _out_of_space(error):
        return KeySpaceFull(f"{doing} failed: the KeySpace is out of space ({error}); nothing "
                            "was applied; apply again once it has room")
    return KeySpaceFailed(f"{doing} failed: {error}")


def _out_of_space(error: BaseException) -> bool:
    """Whether `error`, or one it was raised from, says the storage is full: SQLite's
    SQLITE_FULL, an OSError of a full disk, etcd's RESOURCE_EXHAUSTED (its space quota)."""
    # (etcd's refusal reaches here as the text of a KeySpaceError only: its own message)
    return _ETCD_NO_SPACE in str(error) or any(_says_full(c) for c in causes(error))


def _says_full(error: BaseException) -> bool:
    if isinstance(error, sqlite3.Error):
        return (getattr(error, "sqlite_errorcode", 0) & 0xFF) == sqlite3.SQLITE_FULL
    if isinstance(error, OSError):
        return error.errno in NO_SPACE
    code = getattr(error, "code", None)  # a gRPC error (etcd's): code() is its status
    return (isinstance(error, grpc.RpcError) and callable(code)
            and code() == grpc.StatusCode.RESOURCE_EXHAUSTED)
