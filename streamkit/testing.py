"""Run an application in-process against a real, private broker: for users' own tests.

    async with AppHarness("path/to/myapp") as h:
        await h.publish("events", [{"key": "a", "n": 1}])
        await h.wait_idle()
        assert await h.query({"key": "a"}, key="a") == 1

The broker serves from a temporary directory on a free 127.0.0.1 port, in the
same event loop; the app's journals and shards are created from its
streamkit.yaml, and every shard runs here as primary with the configured
store, recovery logs included. Nothing is mocked: what passes here is what
`streamkit run` does.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from streamkit.app.application import Application, QueryError
from streamkit.app.config import AppConfig, StoreConfig, load_config
from streamkit.app.member import Member, MemberOptions, deploy
from streamkit.app.replica import Replica
from streamkit.broker.server import Broker, BrokerConfig
from streamkit.client import BrokerClient, write_head
from streamkit.client.append_service import AppendService
from streamkit.keyspace import open_keyspace
from streamkit.message.publisher import Publisher
from streamkit.message.reader import ReadCommitted, ReadUncommitted
from streamkit.stores.store import Store

__all__ = ["AppHarness", "read_journals"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def read_journals(client: BrokerClient, journals: Iterable[str],
                        reader: type[ReadCommitted | ReadUncommitted] = ReadCommitted
                        ) -> list[Any]:
    """Every message of the journals up to their write heads (read-committed by default)."""
    out = []
    for journal in journals:
        messages = reader(client, journal, block=False)
        try:
            async for env in messages:
                out.append(env.message)
        finally:
            messages.close()
    return out


class AppHarness:
    """An application with its own broker and shards, in this process (see module docstring).

    `store` overrides the store kind of streamkit.yaml; `app_class` the
    application it names.
    """

    def __init__(self, app_dir: str | Path, *, store: str | None = None,
                 app_class: type[Application] | None = None) -> None:
        self.app_dir = Path(app_dir)
        config = load_config(self.app_dir)
        self.app_class = app_class or config.load_application()
        config = config.with_store(store) if store else config.for_application(self.app_class)
        self._tmp = Path(tempfile.mkdtemp(prefix="streamkit-harness-"))
        if config.store_kind == "sql" and config.store.url is None:
            # The default database lives in the app's folder: keep tests out of it.
            url = f"sqlite:///{self._tmp / 'store.sqlite'}"
            config = config.model_copy(update={"store": StoreConfig(kind="sql", url=url)})
        self.config: AppConfig = config
        self.broker: Broker | None = None
        self.client: BrokerClient | None = None
        self.member: Member | None = None
        self._appends: AppendService | None = None
        self._publisher: Publisher | None = None

    async def __aenter__(self) -> AppHarness:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        port = _free_port()
        self.broker = Broker(BrokerConfig(data_dir=self._tmp / "broker", port=port, http_port=0,
                                          keyspace=str(self._tmp / "keyspace.db")))
        await self.broker.start()
        self.client = BrokerClient(f"127.0.0.1:{port}")
        keyspace = open_keyspace(str(self._tmp / "keyspace.db"))
        await deploy(self.config, self.client, keyspace)
        self.member = Member(self.config, self.app_class, self.client, keyspace,
                             MemberOptions(work_dir=self._tmp / "shards", allocate=False,
                                           hint_interval=5.0))
        await self.member.start()
        self._appends = AppendService(self.client)
        self._publisher = Publisher(self._appends)

    async def close(self) -> None:
        if self._appends is not None:
            await self._appends.close()
        if self.member is not None:
            await self.member.stop()
            await self.member.keyspace.close()
        if self.client is not None:
            await self.client.close()
        if self.broker is not None:
            await self.broker.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)

    # --- driving the app ----------------------------------------------------------

    @property
    def replicas(self) -> Mapping[str, Replica]:
        assert self.member is not None, "the harness is not started"
        return self.member.service.replicas

    def app(self, shard: str) -> Application:
        """The Application instance of a shard."""
        return self.replicas[shard].app

    def store(self, shard: str) -> Store:
        store = self.replicas[shard].store
        if store is None:
            raise QueryError(f"shard {shard} has no open store")
        return store

    async def publish(self, topic: str, messages: Iterable[Any]) -> None:
        """Publish committed messages to a topic (routed by its key) and wait until durable."""
        assert self._publisher is not None and self._appends is not None
        mapping = self.config.mapping_for(topic)
        for message in messages:
            await self._publisher.publish_committed(mapping, message)
        await self._appends.flush()

    async def wait_idle(self, timeout: float = 30.0) -> None:
        """Until every shard processed its sources up to their current write heads.

        Raises if a shard fails meanwhile (with its error).
        """
        async with asyncio.timeout(timeout):
            heads = {journal: await self._head(journal)
                     for replica in self.replicas.values() for journal in replica.shard.sources}
            for replica in self.replicas.values():
                wanted = {j: heads[j] for j in replica.shard.sources}
                waiting = asyncio.ensure_future(replica.shard.progress.wait_for(wanted))
                ended = asyncio.ensure_future(replica.wait())
                await asyncio.wait((waiting, ended), return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                ended.cancel()
                if replica.status.errors:
                    raise AssertionError(f"shard {replica.id} failed: {replica.status.errors[0]}")

    async def query(self, request: dict[str, Any], *, key: Any = None,
                    shard: str | None = None) -> Any:
        """Ask the shard that owns `key` (by the first source topic's routing), or `shard`."""
        if shard is None:
            if key is None:
                raise ValueError("query needs a key or a shard")
            shard = self.shard_of(key)
        return await self.replicas[shard].query(request)

    def shard_of(self, key: Any) -> str:
        """The shard reading the partition of the first source topic that `key` maps to."""
        source = self.config.sources[0]
        message = {source.key or "key": key}
        journal, _ = self.config.mapping_for(source.topic)(message)
        for replica in self.replicas.values():
            if journal in replica.shard.sources:
                return replica.id
        raise LookupError(f"no shard reads {journal}")

    async def read_output(self, topic: str) -> list[Any]:
        """The read-committed messages of every partition of a topic, to their write heads."""
        assert self.client is not None
        return await read_journals(self.client, self.config.topic_journals(topic))

    async def _head(self, journal: str) -> int:
        assert self.client is not None
        return await write_head(self.client, journal)
