"""The journal client: readers, appenders, the AppendService, and listing helpers.

Each name is imported on first use (`streamkit.lazy_exports`): importing any module of
this package runs this file, and a process using one part (the broker, the CLI's
commands) should not pay for the others (the fragment codecs, say).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamkit import lazy_exports

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from streamkit.client.append_service import (  # noqa: F401
        AppendService,
        AsyncAppend,
        OpFuture,
        ServiceClosed,
    )
    from streamkit.client.appender import Appender, append_bytes, write_head  # noqa: F401
    from streamkit.client.broker_client import BrokerClient  # noqa: F401
    from streamkit.client.errors import (  # noqa: F401
        BrokerError,
        BrokerUnavailable,
        EtcdTransactionFailed,
        FragmentError,
        JournalNotFound,
        NotAllowed,
        OffsetJump,
        OffsetNotYetAvailable,
        ProtocolError,
        RegisterMismatch,
        TransportError,
        WrongAppendOffset,
        is_transient,
    )
    from streamkit.client.fragment_reader import FragmentReader, open_fragment  # noqa: F401
    from streamkit.client.listing import (  # noqa: F401
        PolledList,
        apply_journals,
        apply_journals_in_batches,
        get_journal,
        list_fragments,
        list_journals,
    )
    from streamkit.client.reader import Reader, RetryReader  # noqa: F401

_EXPORTS = {
    "streamkit.client.append_service": ("AppendService", "AsyncAppend", "OpFuture",
                                        "ServiceClosed"),
    "streamkit.client.appender": ("Appender", "append_bytes", "write_head"),
    "streamkit.client.broker_client": ("BrokerClient",),
    "streamkit.client.errors": ("BrokerError", "BrokerUnavailable", "EtcdTransactionFailed",
                                "FragmentError", "JournalNotFound", "NotAllowed", "OffsetJump",
                                "OffsetNotYetAvailable", "ProtocolError", "RegisterMismatch",
                                "TransportError", "WrongAppendOffset", "is_transient"),
    "streamkit.client.fragment_reader": ("FragmentReader", "open_fragment"),
    "streamkit.client.listing": ("PolledList", "apply_journals", "apply_journals_in_batches",
                                 "get_journal", "list_fragments", "list_journals"),
    "streamkit.client.reader": ("Reader", "RetryReader"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
