"""Application hooks that choose what a shard reads: read_sources, replay_range, read_through.

Against a real broker, with Runtimes built by hand as in test_app_runtime.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from streamkit.app.producer import EnvelopeReader
from streamkit.app.service import Service
from streamkit.app.shard_api import ShardAPI
from streamkit.client import BrokerClient
from streamkit.client.append_service import AppendService
from streamkit.message.mapping import StaticPartitions, field_key, modulo_mapping
from streamkit.message.publisher import Publisher
from streamkit.message.reader import ReadUncommitted
from streamkit.protocol import consumer_pb, pb
from tests.helpers_client import create_journal, unique_name
from tests.test_app_runtime import (
    NDJSON,
    WordCount,
    _journals,
    _publish_lines,
    _runtime,
    _specs,
    _wait_processed,
)
from tests.waiting import DEADLINE

Code = consumer_pb.ReplicaStatus.Code


class TwoJournals(WordCount):
    """Reads its spec's source and, beyond the spec, `extra`."""

    extra = ""

    def read_sources(self, shard: Any, store: Any, offsets: dict[str, int]) -> list[Any]:
        journals = [*shard.sources, self.extra]
        readers = [ReadUncommitted(shard.client, j, dict, offsets.get(j, 0)) for j in journals]
        assert all(isinstance(r, EnvelopeReader) for r in readers)
        return readers


class CountedReplays(WordCount):
    """Re-reads ranges itself, counting how often the sequencer asked."""

    replays: list[tuple[str, int, int]] = []

    def replay_range(self, shard: Any, store: Any, journal: str, begin: int, end: int) -> Any:
        self.replays.append((journal, begin, end))
        return ReadUncommitted(shard.client, journal, dict, begin, True, end_offset=end)


class Aliased(WordCount):
    """Answers Stat for "alias/lines" with its real source's offsets."""

    asked: list[dict[str, int]] = []

    def read_through(self, shard: Any, store: Any, offsets: dict[str, int]) -> dict[str, int]:
        self.asked.append(dict(offsets))
        return {shard.sources[0] if j == "alias/lines" else j: o for j, o in offsets.items()}


async def _head(client: BrokerClient, journal: str) -> int:
    reader = ReadUncommitted(client, journal, dict, 0, False)
    while await reader.read_batch():
        pass
    reader.close()
    return reader.offset


async def _wait_read(replica: Any, journal: str, offset: int) -> None:
    await asyncio.wait_for(replica.shard.progress.wait_for({journal: offset}), DEADLINE)


async def test_read_sources_beyond_the_spec(shared_broker: Any, tmp_path: Path) -> None:
    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("producer")
        journals = await _journals(client, base, 1)
        extra = f"{base}/extra/part-000"
        await create_journal(client, extra, labels=NDJSON)
        specs = _specs(base, journals["inputs"])
        TwoJournals.extra = extra
        await _publish_lines(client, journals["inputs"], ["a b"] * 5)
        await _publish_lines(client, [extra], ["b c"] * 3)
        service = Service(_runtime(TwoJournals, client, tmp_path, journals["outputs"]))
        await service.assign(specs, {sid: 0 for sid in specs})
        replica = service.replicas["shard-000"]
        await _wait_processed(service, client, journals["inputs"])
        await _wait_read(replica, extra, await _head(client, extra))
        assert [await replica.query({"word": w}) for w in "abc"] == [5, 8, 3]
        await service.stop()

        # A new primary resumes the extra journal where the checkpoint says.
        await _publish_lines(client, [extra], ["c"] * 2)
        service = Service(_runtime(TwoJournals, client, tmp_path, journals["outputs"]))
        await service.assign(specs, {sid: 0 for sid in specs})
        replica = service.replicas["shard-000"]
        await _wait_read(replica, extra, await _head(client, extra))
        assert [await replica.query({"word": w}) for w in "abc"] == [5, 8, 5]
        await service.stop()


async def test_replay_range_reads_what_the_ring_lost(shared_broker: Any, tmp_path: Path) -> None:
    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("producer")
        journals = await _journals(client, base, 1)
        specs = _specs(base, journals["inputs"])
        specs["shard-000"].ring_buffer_size = 4
        source = journals["inputs"][0]
        CountedReplays.replays = []
        service = Service(_runtime(CountedReplays, client, tmp_path, journals["outputs"]))
        await service.assign(specs, {sid: 0 for sid in specs})
        partitions = StaticPartitions([pb.ListResponse.Journal(spec=pb.JournalSpec(
            name=source, labels=pb.LabelSet(labels=[pb.Label(name="content-type",
                                                             value=NDJSON["content-type"])])))])
        mapping = modulo_mapping(field_key("line"), partitions)
        async with AppendService(client) as appends:
            publisher = Publisher(appends)
            for i in range(50):
                await publisher.publish_uncommitted(mapping, {"line": f"x y{i % 2}"})
            await appends.flush()
            for intent in publisher.build_ack_intents():
                await (await appends.append(intent.journal, intent.content))
        await _wait_processed(service, client, journals["inputs"])
        replica = service.replicas["shard-000"]
        assert CountedReplays.replays and all(r[0] == source for r in CountedReplays.replays)
        assert [await replica.query({"word": w}) for w in ("x", "y0", "y1")] == [50, 25, 25]
        await service.stop()


async def test_stat_maps_read_through(shared_broker: Any, tmp_path: Path) -> None:
    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("producer")
        journals = await _journals(client, base, 1)
        specs = _specs(base, journals["inputs"])
        Aliased.asked = []
        runtime = _runtime(Aliased, client, tmp_path, journals["outputs"])
        service = Service(runtime)
        await service.assign(specs, {sid: 0 for sid in specs})
        replica = service.replicas["shard-000"]
        await asyncio.wait_for(_until_primary(replica), DEADLINE)
        assert runtime.keyspace is not None
        api = ShardAPI(runtime.keyspace, "/test", service, "grpc://127.0.0.1:1")
        request = consumer_pb.StatRequest(shard="shard-000", read_through={"alias/lines": 1})
        stat = asyncio.ensure_future(api.Stat(request, None))
        await asyncio.sleep(0.3)  # a negative check: nothing was published, nothing may answer
        assert not stat.done(), "Stat answered before the aliased source was read"
        await _publish_lines(client, journals["inputs"], ["a"])
        response = await asyncio.wait_for(stat, DEADLINE)
        assert response.status == consumer_pb.OK
        assert response.read_through[journals["inputs"][0]] >= 1
        assert Aliased.asked == [{"alias/lines": 1}]
        await service.stop()


async def _until_primary(replica: Any) -> None:
    while replica.status.code != Code.PRIMARY:
        await replica.changed.wait()
