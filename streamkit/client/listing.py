"""Listing and applying journal specs, listing fragments, and PolledList.

These wrap the List, Apply and ListFragments RPCs so that callers never deal
with response chunking or pagination, and see non-OK statuses as errors.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from datetime import timedelta
from types import TracebackType

import grpc
from google.protobuf.duration_pb2 import Duration

from streamkit.auth.tokens import Capability
from streamkit.client.broker_client import BrokerClient
from streamkit.client.errors import Backoff, JournalNotFound, check_status, translating_rpc_errors
from streamkit.protocol import pb
from streamkit.protocol.labels import parse_selector
from streamkit.tasks import cancel_and_wait

__all__ = [
    "PolledList",
    "apply_journals",
    "apply_journals_in_batches",
    "get_journal",
    "list_fragments",
    "list_journals",
]

log = logging.getLogger(__name__)

Selector = pb.LabelSelector | str | None
Journals = list[pb.ListResponse.Journal]


def _selector(selector: Selector) -> pb.LabelSelector:
    if selector is None:
        return pb.LabelSelector()
    if isinstance(selector, str):
        return parse_selector(selector)
    return selector


def _remember_routes(client: BrokerClient, journals: Iterable[pb.ListResponse.Journal]) -> None:
    for journal in journals:
        client.update_route(journal.spec.name, journal.route)


async def list_journals(client: BrokerClient, selector: Selector = None) -> Journals:
    """Every journal matching `selector` (text like "app=x, prefix=logs/" or a LabelSelector)."""
    journals: Journals = []
    request = pb.ListRequest(selector=_selector(selector))
    metadata = client.auth(Capability.LIST, selector=request.selector)
    with translating_rpc_errors("list journals"):
        async for response in client.stub.List(request, metadata=metadata):
            check_status(response.status, "list journals")
            journals.extend(response.journals)
    _remember_routes(client, journals)
    return journals


async def get_journal(client: BrokerClient, name: str) -> pb.JournalSpec:
    """The spec of journal `name`; raises JournalNotFound."""
    selector = pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="name", value=name)]))
    for journal in await list_journals(client, selector):
        if journal.spec.name == name:
            return journal.spec
    raise JournalNotFound(detail=name)


async def apply_journals(
    client: BrokerClient, changes: pb.ApplyRequest | Iterable[pb.ApplyRequest.Change]
) -> pb.ApplyResponse:
    """Apply the changes in one transaction (a stale expect_mod_revision fails all)."""
    request = changes if isinstance(changes, pb.ApplyRequest) else pb.ApplyRequest(changes=changes)
    what = f"apply {len(request.changes)} journal change(s)"
    with translating_rpc_errors(what):
        response = await client.stub.Apply(request, metadata=client.auth(Capability.APPLY))
    check_status(response.status, what)
    return response


async def apply_journals_in_batches(
    client: BrokerClient,
    changes: pb.ApplyRequest | Iterable[pb.ApplyRequest.Change],
    size: int,
) -> pb.ApplyResponse:
    """Apply changes in transactions of at most `size` (0: all at once).

    Batches before a failing one stay applied. Returns the last response.
    """
    all_changes: Sequence[pb.ApplyRequest.Change] = list(
        changes.changes if isinstance(changes, pb.ApplyRequest) else changes
    )
    if size <= 0 or len(all_changes) <= size:
        return await apply_journals(client, all_changes)
    response = pb.ApplyResponse()
    for start in range(0, len(all_changes), size):
        response = await apply_journals(client, all_changes[start : start + size])
    return response


async def list_fragments(
    client: BrokerClient,
    journal: str,
    begin_mod_time: int = 0,
    end_mod_time: int = 0,
    signature_ttl: timedelta | None = None,
    *,
    page_limit: int = 0,
) -> pb.FragmentsResponse:
    """All fragments of `journal` (following pages), merged into one FragmentsResponse.

    Mod times are epoch seconds (0: unbounded). With `signature_ttl`, each
    persisted fragment carries a URL to read it directly.
    """
    request = pb.FragmentsRequest(
        journal=journal,
        begin_mod_time=begin_mod_time,
        end_mod_time=end_mod_time,
        page_limit=page_limit,
    )
    if signature_ttl is not None:
        request.signatureTTL.CopyFrom(Duration(seconds=int(signature_ttl.total_seconds())))
    merged = pb.FragmentsResponse(status=pb.OK)
    metadata = client.auth(Capability.READ, journal)  # READ: it hands out fragment URLs
    while True:
        with translating_rpc_errors(f"list fragments of {journal}"):
            response = await client.stub_for(journal).ListFragments(request, metadata=metadata)
        check_status(response.status, f"list fragments of {journal}")
        if not merged.HasField("header"):
            merged.header.CopyFrom(response.header)
            client.update_route(journal, response.header.route)
        merged.fragments.extend(response.fragments)
        if not response.next_page_token:
            return merged
        request.next_page_token = response.next_page_token


class PolledList:
    """The journals matching a selector, kept current in the background.

    It follows the List RPC's watch mode (a fresh snapshot after every
    change); brokers without it are polled every `interval` seconds instead.
    `current` is the latest listing; `await wait_update()` or `async for
    journals in polled` observe changes. Errors after the first listing are
    logged and retried.
    """

    def __init__(
        self,
        client: BrokerClient,
        selector: Selector = None,
        interval: float = 30.0,
        *,
        watch: bool = True,
    ) -> None:
        self.client = client
        self.selector = _selector(selector)
        self.interval = interval
        self.watch = watch
        self.current: Journals = []
        self.version = 0  # incremented with each change of `current`
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._backoff = Backoff(first=0.5, ceiling=max(interval, 0.5))  # after watch failures

    async def start(self) -> PolledList:
        """List once (raising any error), then keep refreshing in a task."""
        self._publish(await list_journals(self.client, self.selector))
        self._task = asyncio.create_task(self._run())
        return self

    async def __aenter__(self) -> PolledList:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task, "following the journal listing")

    async def wait_update(self) -> Journals:
        """Wait for the next change of the listing and return it."""
        await self._changed.wait()
        return self.current

    def __aiter__(self) -> AsyncIterator[Journals]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Journals]:
        """The current listing, then each changed one (intermediate ones may be skipped)."""
        seen = -1
        while True:
            if self.version == seen:
                await self.wait_update()
            seen = self.version
            yield self.current

    def _publish(self, journals: Journals) -> None:
        if journals == self.current and self.version:
            return
        _remember_routes(self.client, journals)
        self.current = journals
        self.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _run(self) -> None:
        while True:
            try:
                if not self.watch:
                    await asyncio.sleep(self.interval)
                    self._publish(await list_journals(self.client, self.selector))
                    continue
                await self._follow()  # returns if the broker ends the watch
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.watch = False
                    continue
                log.warning("watching the journal list failed: %s", err.details())
            except Exception as err:
                log.warning("refreshing the journal list failed: %r", err)
            await self._backoff.sleep()

    async def _follow(self) -> None:
        """Publish each snapshot of a watching List RPC; an empty message ends one."""
        metadata = self.client.auth(Capability.LIST, selector=self.selector)
        call = self.client.stub.List(pb.ListRequest(selector=self.selector, watch=True),
                                     metadata=metadata)
        try:
            snapshot: Journals = []
            async for response in call:
                check_status(response.status, "watch journals")
                if response.journals:
                    snapshot.extend(response.journals)
                else:
                    self._publish(snapshot)
                    self._backoff.reset()
                    snapshot = []
        finally:
            call.cancel()
