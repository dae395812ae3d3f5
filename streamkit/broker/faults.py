"""Faults of one journal: what went wrong, and the status each front end answers.

A fault fails the one operation that met it, never the broker: the gRPC
service aborts the RPC with `grpc_code`, the HTTP gateway answers
`http_status`, and both say which journal and why. The journal serves the
next request as well as it can (an append after a full disk works again
once there is space).
"""

from __future__ import annotations

import errno

import grpc

from streamkit.errors import StreamkitError

__all__ = [
    "ContentLost",
    "JournalFault",
    "JournalUnavailable",
    "StorageExhausted",
    "StorageFailed",
    "StoreGone",
    "StoresUnlisted",
    "storage_fault",
]

# Out of space: the device is full, the file may not grow (RLIMIT_FSIZE), a quota.
_NO_SPACE = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


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
    """The fault for an OSError (or a store's error) met while `doing` something."""
    reason = getattr(error, "strerror", None) or str(error)
    if getattr(error, "errno", None) in _NO_SPACE:
        return StorageExhausted(
            journal, f"{doing} failed: {reason} (the broker's disk is full or the file may "
                     "not grow); rolled back, appends work again once there is room")
    return StorageFailed(journal, f"{doing} failed: {reason}")
