"""The journal client: readers, appenders, the AppendService, and listing helpers."""

from streamkit.client.append_service import AppendService, AsyncAppend, OpFuture, ServiceClosed
from streamkit.client.appender import Appender, append_bytes, write_head
from streamkit.client.broker_client import BrokerClient
from streamkit.client.errors import (
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
from streamkit.client.fragment_reader import FragmentReader, open_fragment
from streamkit.client.listing import (
    PolledList,
    apply_journals,
    apply_journals_in_batches,
    get_journal,
    list_fragments,
    list_journals,
)
from streamkit.client.reader import Reader, RetryReader

__all__ = [
    "AppendService",
    "Appender",
    "AsyncAppend",
    "BrokerClient",
    "BrokerError",
    "BrokerUnavailable",
    "EtcdTransactionFailed",
    "FragmentError",
    "FragmentReader",
    "JournalNotFound",
    "NotAllowed",
    "OffsetJump",
    "OffsetNotYetAvailable",
    "OpFuture",
    "PolledList",
    "ProtocolError",
    "Reader",
    "RegisterMismatch",
    "RetryReader",
    "ServiceClosed",
    "TransportError",
    "WrongAppendOffset",
    "append_bytes",
    "apply_journals",
    "apply_journals_in_batches",
    "get_journal",
    "is_transient",
    "list_fragments",
    "list_journals",
    "open_fragment",
    "write_head",
]
