"""Publisher against a real broker: framed messages, UUID flags and clocks, ACK intents."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest

from streamkit.app.service import Service
from streamkit.client import AppendService, BrokerClient, list_journals
from streamkit.message.framing import UnknownFraming, framing_for
from streamkit.message.framings.json_lines import NonFiniteNumber
from streamkit.message.mapping import (
    EmptyPartitions,
    MappingFunc,
    StaticPartitions,
    field_key,
    modulo_mapping,
)
from streamkit.message.message import Message
from streamkit.message.publisher import AckIntent, Publisher
from streamkit.message.uuid import UUID, Clock, Flags, clock_at, parse_uuid
from streamkit.protocol import consumer_pb
from tests.brokerproc import BrokerProcess
from tests.helpers_client import create_journal, eventually, read_range, unique_name
from tests.test_app_runtime import (
    WordCount,
    _journals,
    _publish_lines,
    _read_counts,
    _runtime,
    _specs,
)

NDJSON = "application/x-ndjson"


@pytest.fixture
async def client(shared_broker: BrokerProcess) -> AsyncIterator[BrokerClient]:
    async with BrokerClient(shared_broker.address) as c:
        yield c


@pytest.fixture
async def service(client: BrokerClient) -> AsyncIterator[AppendService]:
    async with AppendService(client) as s:
        yield s


async def topic(client: BrokerClient, count: int, content_type: str = NDJSON) -> list[str]:
    """`count` fresh journals labeled as one topic; their names, sorted."""
    prefix = unique_name("pub")
    names = [f"{prefix}/part-{i}" for i in range(count)]
    for name in names:
        await create_journal(client, name, labels={"content-type": content_type,
                                                   "topic": prefix.replace("/", "-")})
    return names


async def keyed_mapping(client: BrokerClient, names: list[str]) -> MappingFunc:
    listed = [j for j in await list_journals(client) if j.spec.name in names]
    return modulo_mapping(field_key("key"), StaticPartitions(listed))


def fixed(journal: str) -> MappingFunc:
    return lambda message: (journal, NDJSON)


async def lines_of(client: BrokerClient, journal: str, end: int) -> list[dict[str, Any]]:
    content = await read_range(client, journal, 0, end)
    return [orjson.loads(line) for line in content.splitlines()]


def uuid_parts(message: dict[str, Any]) -> tuple[bytes, int, int]:
    return parse_uuid(UUID(message["uuid"]))


async def test_committed_messages_land_framed_with_outside_txn_uuids(
    client: BrokerClient, service: AppendService
) -> None:
    names = await topic(client, 3)
    mapping = await keyed_mapping(client, names)
    publisher = Publisher(service)
    futures = {}
    for n in range(60):
        message = {"n": n, "key": f"user-{n % 7}"}
        futures[mapping(message)[0]] = await publisher.publish_committed(mapping, message)
    await service.flush()

    seen = []
    before = clock_at(0)
    for journal, future in futures.items():
        messages = await lines_of(client, journal, (await future).commit.end)
        clocks = []
        for message in messages:
            producer, clock, flags = uuid_parts(message)
            assert (producer, flags) == (publisher.producer, Flags.OUTSIDE_TXN)
            assert mapping(message)[0] == journal  # where the key maps it
            clocks.append(clock)
            seen.append(message["n"])
        assert clocks == sorted(clocks) and len(set(clocks)) == len(clocks)  # increasing
        assert clocks[0] > before
    assert sorted(seen) == list(range(60))
    assert len(futures) == 3


async def test_uncommitted_then_one_ack_per_journal(
    client: BrokerClient, service: AppendService
) -> None:
    a, b, untouched = await topic(client, 3)
    publisher = Publisher(service)
    for n in range(5):
        await publisher.publish_uncommitted(fixed(a), {"n": n})
        await publisher.publish_uncommitted(fixed(b), {"n": n})
    intents = publisher.build_ack_intents()
    assert [i.journal for i in intents] == [a, b]
    assert publisher.build_ack_intents() == []  # the set was reset

    ends = {}
    for intent in intents:
        assert isinstance(intent, AckIntent) and intent.content.endswith(b"\n")
        ends[intent.journal] = (await service.append(intent.journal, intent.content))
    for journal in (a, b):
        *data, ack = await lines_of(client, journal, (await ends[journal]).commit.end)
        assert [m["n"] for m in data] == list(range(5))
        assert all(uuid_parts(m)[2] == Flags.CONTINUE_TXN for m in data)
        producer, ack_clock, flags = uuid_parts(ack)
        assert (producer, flags) == (publisher.producer, Flags.ACK_TXN)
        assert ack_clock > max(uuid_parts(m)[1] for m in data)
        assert set(ack) == {"uuid"}  # an empty message of the same kind
    assert untouched not in ends


async def test_shared_clock_is_ticked_not_updated(service: AppendService,
                                                  client: BrokerClient) -> None:
    (journal,) = await topic(client, 1)
    clock = Clock(clock_at(1_000_000_000 * 10**9))  # 2001: far behind wall time
    publisher = Publisher(service, clock=clock, producer=b"\x01abcde")
    first, second = {"n": 1}, {"n": 2}
    await publisher.publish_committed(fixed(journal), first)
    await publisher.publish_uncommitted(fixed(journal), second)
    assert uuid_parts(first) == (b"\x01abcde", clock_at(10**18) + 1, Flags.OUTSIDE_TXN)
    assert uuid_parts(second) == (b"\x01abcde", clock_at(10**18) + 2, Flags.CONTINUE_TXN)
    (ack,) = publisher.build_ack_intents()
    assert uuid_parts(orjson.loads(ack.content))[1:] == (clock_at(10**18) + 3, Flags.ACK_TXN)


class Order(Message):
    order_id: str
    amount: int

    def validate_message(self) -> None:
        if self.amount <= 0:
            raise ValueError("amount must be positive")


class Metric(Message):
    uses_uuid: ClassVar[bool] = False
    value: float


async def test_errors_surface_before_anything_is_appended(
    client: BrokerClient, service: AppendService
) -> None:
    (journal,) = await topic(client, 1)
    (raw,) = await topic(client, 1, content_type="application/octet-stream")
    publisher = Publisher(service)
    invalid = Order(order_id="o-1", amount=0)
    with pytest.raises(ValueError, match="amount must be positive"):
        await publisher.publish_committed(fixed(journal), invalid)
    assert invalid.uuid is None  # validated before any UUID was assigned
    with pytest.raises(EmptyPartitions, match="'topic=nothing'"):
        empty = modulo_mapping(field_key("order_id"), StaticPartitions([], "topic=nothing"))
        await publisher.publish_uncommitted(empty, Order(order_id="o-2", amount=1))
    with pytest.raises(UnknownFraming):
        await publisher.publish_uncommitted(lambda m: (raw, "application/octet-stream"),
                                            Order(order_id="o-3", amount=1))
    with pytest.raises(TypeError):  # orjson can't encode a set: fails while framing
        await publisher.publish_uncommitted(fixed(journal), {"tags": {"a", "b"}})
    assert publisher.build_ack_intents() == []  # nothing was published uncommitted

    future = await publisher.publish_committed(fixed(journal), Order(order_id="o-4", amount=5))
    (only,) = await lines_of(client, journal, (await future).commit.end)
    assert only["order_id"] == "o-4" and (await future).commit.begin == 0


async def test_messages_without_uuids_get_no_acknowledgement(
    client: BrokerClient, service: AppendService
) -> None:
    (journal,) = await topic(client, 1)
    publisher = Publisher(service)
    await publisher.publish_uncommitted(fixed(journal), Metric(value=1.5))
    assert publisher.build_ack_intents() == []
    await publisher.publish_uncommitted(fixed(journal), Order(order_id="o", amount=1))
    (intent,) = publisher.build_ack_intents()
    ack = orjson.loads(intent.content)
    assert uuid_parts(ack)[2] == Flags.ACK_TXN


def test_producer_id_must_be_six_bytes() -> None:
    with pytest.raises(ValueError, match="6 bytes"):
        Publisher(AppendService(BrokerClient("127.0.0.1:1")), producer=b"short")


@pytest.mark.parametrize("content_type", [NDJSON, "text/csv"])
async def test_a_dict_is_framed_as_its_framing_encodes_it(
    client: BrokerClient, service: AppendService, content_type: str
) -> None:
    """ndjson's `frame_dict` (the Publisher's short way for dicts) and csv's `encode` (it has
    no frame_dict) give the bytes `encode` gives for the message with its UUID."""
    (journal,) = await topic(client, 1, content_type=content_type)
    publisher = Publisher(service)
    messages = [{"n": n, "text": "a, \"quoted\"\nline", "ok": n % 2 == 0} for n in range(3)]
    for message in messages:
        await publisher.publish_uncommitted(lambda m: (journal, content_type), message)
    (intent,) = publisher.build_ack_intents()
    end = (await (await service.append(journal, intent.content))).commit.end
    framing = framing_for(content_type)
    expected = bytearray()
    for message in messages:  # each now holds the UUID it was published with
        framing.encode(message, expected)
    assert (await read_range(client, journal, 0, end)).startswith(bytes(expected))
    assert (getattr(framing, "frame_dict", None) is not None) == (content_type == NDJSON)


class _RatioCount(WordCount):
    """Publishes a ratio it could not compute (NaN) with each word's count."""

    def finalize_txn(self, shard: Any, store: Any, publisher: Any) -> None:
        for word in self.deltas:
            publisher.publish("counts", {"word": word, "count": 1, "shard": shard.id,
                                         "ratio": float("nan")})
        self.deltas.clear()


@dataclasses.dataclass
class Point:
    x: float
    y: float


class Reading(Message):
    value: float
    note: str | None = None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
async def test_nan_and_infinity_are_refused_not_published_as_null(
    client: BrokerClient, service: AppendService, bad: float
) -> None:
    """orjson (and pydantic) write them as null: the message would change silently."""
    (journal,) = await topic(client, 1)
    publisher = Publisher(service)
    with pytest.raises(NonFiniteNumber, match=rf"message\['xs'\]\[1\]\['v'\] = {bad!r}: JSON"):
        await publisher.publish_uncommitted(fixed(journal), {"xs": [None, {"v": bad}]})
    with pytest.raises(ValueError, match=rf"message\['value'\] = {bad!r}.*Reading\("):
        await publisher.publish_committed(fixed(journal), Reading(value=bad))
    # In a dataclass of a dict too (orjson writes its fields): it slipped through as null.
    with pytest.raises(NonFiniteNumber, match=rf"message\['p'\]\.y = {bad!r}: JSON"):
        await publisher.publish_uncommitted(fixed(journal), {"p": Point(1.0, bad), "q": None})
    # A None (null as well) is published as ever; so are finite floats.
    await publisher.publish_uncommitted(fixed(journal), {"xs": [None, {"v": 1.5}]})
    future = await publisher.publish_committed(fixed(journal), Reading(value=2.5))
    lines = await lines_of(client, journal, (await future).commit.end)
    assert [line.get("xs", line.get("value")) for line in lines] == [[None, {"v": 1.5}], 2.5]


async def test_nan_published_by_finalize_txn_fails_the_transaction(
    shared_broker: BrokerProcess, tmp_path: Path
) -> None:
    """The shard fails naming the field; no count (and no null) reaches the output."""
    async with BrokerClient(shared_broker.address) as client:
        base = unique_name("app")
        journals = await _journals(client, base, 1)
        service = Service(_runtime(_RatioCount, client, tmp_path, journals["outputs"]))
        specs = _specs(base, journals["inputs"])
        try:
            await service.assign(specs, {sid: 0 for sid in specs})
            await _publish_lines(client, journals["inputs"], ["a b"])
            replica = service.replicas["shard-000"]
            await eventually(lambda: replica.status.code == consumer_pb.ReplicaStatus.FAILED)
            assert "message['ratio'] = nan: JSON has no NaN" in replica.status.errors[0]
            assert await _read_counts(client, journals["outputs"]) == {}
        finally:
            await service.stop()
