"""One append transaction against a replica, shared by the gRPC and HTTP front ends.

The caller holds nothing; `append` takes the journal's append lock, checks the
preconditions, streams the content into the spool and commits it durably. A
storage failure (a full disk) raises a JournalFault and leaves the journal as
it was: the append is rolled back, and the next one writes at the same offset.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from streamkit.broker import metrics
from streamkit.broker.faults import JournalFault, JournalUnavailable, storage_fault
from streamkit.broker.replica import Replica
from streamkit.broker.spool import SpoolAppend
from streamkit.errors import StreamkitError
from streamkit.protocol import pb
from streamkit.protocol.labels import registers_match, subtract, union

T = TypeVar("T")


class RolledBack(StreamkitError):
    """The content stream ended without committing; nothing was appended."""


def refusal(replica: Replica | None) -> int | None:
    """The status refusing an append before any content is read, if any (raises the
    replica's JournalFault if it can't take appends)."""
    if replica is None or replica.deleted:
        return pb.JOURNAL_NOT_FOUND
    if replica.spec.flags == pb.JournalSpec.O_RDONLY:
        return pb.NOT_ALLOWED
    if replica.unavailable is not None:
        raise replica.unavailable
    unknown = replica.unknown_below(replica.write_head)
    if unknown is not None:
        raise unknown
    return None


def _precondition_failure(replica: Replica, request: pb.AppendRequest) -> int | None:
    """Checked under the append lock, in Gazette's order: registers, then offset."""
    status = refusal(replica)
    if status is not None:
        return status
    replica.spool.check_intact()
    if replica.spool.fenced:
        raise JournalUnavailable(replica.name, f"{replica.spool.fenced}; appends are refused "
                                 "until the broker restarts and recovers the spool")
    if request.HasField("check_registers") and not registers_match(
        request.check_registers, replica.registers
    ):
        return pb.REGISTER_MISMATCH
    if request.offset and request.offset != replica.write_head:
        return pb.WRONG_APPEND_OFFSET
    return None


def _new_registers(replica: Replica, request: pb.AppendRequest) -> pb.LabelSet | None:
    if not (request.HasField("union_registers") or request.HasField("subtract_registers")):
        return None
    return subtract(union(replica.registers, request.union_registers), request.subtract_registers)


async def _commit(replica: Replica, txn: SpoolAppend, registers: pb.LabelSet | None
                  ) -> pb.Fragment:
    commit = await txn.commit(registers)
    if registers is not None:
        replica.registers = registers
    replica.committed(replica.spool)
    return commit


def _fault(replica: Replica, doing: str, error: OSError) -> JournalFault:
    fault = storage_fault(replica.name, f"appending: {doing}", error)
    metrics.APPEND_FAILURES.labels(type(fault).__name__).inc()
    return fault


async def settle(work: Coroutine[Any, Any, T]) -> T:
    """Run `work` to completion even if the caller is cancelled meanwhile.

    A cancellation is re-raised once the work is done, so callers still unwind.
    """
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


async def append(
    replica: Replica,
    request: pb.AppendRequest,
    content: AsyncIterator[bytes],
    header: pb.Header,
) -> pb.AppendResponse:
    """Run one append. `content` raising (RolledBack or anything else) rolls it back."""
    async with replica.append_lock:
        status = _precondition_failure(replica, request)
        if status is not None:
            metrics.APPEND_FAILURES.labels(pb.Status.Name(status)).inc()
            return pb.AppendResponse(status=status, header=header, registers=replica.registers)

        try:
            replica.write_head_spool()
            replica.maybe_roll()
        except OSError as error:
            raise _fault(replica, "starting its next spool", error) from error
        txn = replica.spool.start_append()
        chunks = 0
        try:
            async for chunk in content:
                try:
                    await txn.write(chunk)
                except OSError as error:
                    raise _fault(replica, f"writing {txn.length} bytes", error) from error
                chunks += 1
        except BaseException:
            # Rolled back (or cancelled): a chunk still being written must land
            # before the next append may write at the same offset.
            await settle(txn.discard())
            raise
        if replica.deleted:  # while its content came in: acknowledged, it would be lost
            await settle(txn.discard())
            metrics.APPEND_FAILURES.labels(pb.Status.Name(pb.JOURNAL_NOT_FOUND)).inc()
            return pb.AppendResponse(status=pb.JOURNAL_NOT_FOUND, header=header)
        registers = _new_registers(replica, request) if txn.length else None
        # Once the commit record may be written, the commit runs to its end even if
        # the caller goes away: releasing the lock half-way would let the next
        # append overwrite bytes that recovery will then call committed.
        try:
            commit = await settle(_commit(replica, txn, registers))
        except OSError as error:  # nothing was committed: the spool's end did not move
            await settle(txn.discard())
            raise _fault(replica, f"committing {txn.length} bytes", error) from error
    metrics.APPENDS.labels(replica.name).inc()
    metrics.APPEND_BYTES.labels(replica.name).inc(txn.length)
    return pb.AppendResponse(
        status=pb.OK, header=header, commit=commit, registers=replica.registers, total_chunks=chunks
    )
