"""ShardPublisher: what an application publishes with, inside a consumer transaction."""

from __future__ import annotations

from collections.abc import Callable

from streamkit.client.append_service import OpFuture
from streamkit.message.mapping import MappingFunc
from streamkit.message.message import MessageLike
from streamkit.message.publisher import Publisher

__all__ = ["ShardPublisher"]


class ShardPublisher:
    """Publishes uncommitted messages that commit with the shard's transaction.

    `publish("counts", message)` routes by the output topic's partitions and
    key (streamkit.yaml); a MappingFunc may be given instead of a topic.
    Nothing is visible to read-committed readers until the transaction's
    checkpoint is durable and its acknowledgements are appended.
    """

    __slots__ = ("_mappings", "_resolve", "publisher")

    def __init__(self, publisher: Publisher, resolve: Callable[[str], MappingFunc]) -> None:
        self.publisher = publisher
        self._resolve = resolve
        self._mappings: dict[str, MappingFunc] = {}

    def publish(self, topic: str | MappingFunc, message: MessageLike) -> OpFuture:
        """Publish `message` within the current transaction; returns its append's OpFuture."""
        if isinstance(topic, str):
            mapping = self._mappings.get(topic)
            if mapping is None:
                mapping = self._mappings[topic] = self._resolve(topic)
        else:
            mapping = topic
        return self.publisher.publish_uncommitted_nowait(mapping, message)
