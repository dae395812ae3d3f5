"""What an Application's `read_sources` and `replay_range` hooks return.

An application that decides itself what a shard reads (journals beyond its
spec's sources, say) hands the runtime readers of this shape;
`streamkit.message.reader.ReadUncommitted` is one already.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from streamkit.message.message import Envelope

__all__ = ["EnvelopeReader"]


@runtime_checkable
class EnvelopeReader(Protocol):
    """Uncommitted envelopes of one journal, in journal order, batch by batch."""

    journal: str

    async def read_batch(self) -> list[Envelope]:
        """The next envelopes; waits for some, but [] is allowed (the runtime asks again).

        A replay reader returns [] once its range's end is reached.
        """
        ...

    def close(self) -> None:
        """Release the reader's stream."""
        ...
