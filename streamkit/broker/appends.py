"""One append transaction against a replica, shared by the gRPC and HTTP front ends.

The caller holds nothing; `append` takes the journal's append lock, checks the
preconditions, streams the content into the spool and commits it durably.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from streamkit.broker import metrics
from streamkit.broker.replica import Replica
from streamkit.protocol import pb
from streamkit.protocol.labels import registers_match, subtract, union


class RolledBack(Exception):
    """The content stream ended without committing; nothing was appended."""


def refusal(replica: Replica | None) -> int | None:
    """The status refusing an append before any content is read, if any."""
    if replica is None or replica.deleted:
        return pb.JOURNAL_NOT_FOUND
    if replica.spec.flags == pb.JournalSpec.O_RDONLY:
        return pb.NOT_ALLOWED
    return None


def _precondition_failure(replica: Replica, request: pb.AppendRequest) -> int | None:
    """Checked under the append lock, in Gazette's order: registers, then offset."""
    status = refusal(replica)
    if status is not None:
        return status
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

        replica.maybe_roll()
        txn = replica.spool.start_append()
        chunks = 0
        async for chunk in content:
            await txn.write(chunk)
            chunks += 1
        registers = _new_registers(replica, request) if txn.length else None
        commit = await txn.commit(registers)
        if registers is not None:
            replica.registers = registers
        replica.committed(replica.spool)
    metrics.APPENDS.labels(replica.name).inc()
    metrics.APPEND_BYTES.labels(replica.name).inc(txn.length)
    return pb.AppendResponse(
        status=pb.OK, header=header, commit=commit, registers=replica.registers, total_chunks=chunks
    )
