"""Journal listing/applying, fragment listing and PolledList against a real broker."""

from __future__ import annotations

import asyncio

import pytest

from streamkit.client import (
    BrokerClient,
    EtcdTransactionFailed,
    JournalNotFound,
    PolledList,
    append_bytes,
    apply_journals,
    apply_journals_in_batches,
    get_journal,
    list_fragments,
    list_journals,
)
from streamkit.protocol import pb
from tests.brokerproc import BrokerProcess
from tests.helpers_client import create_journal, unique_name


@pytest.fixture
async def client(shared_broker: BrokerProcess):
    async with BrokerClient(shared_broker.address) as c:
        yield c


def _names(journals: list[pb.ListResponse.Journal]) -> list[str]:
    return [j.spec.name for j in journals]


async def test_list_and_get_journals(client: BrokerClient) -> None:
    prefix = unique_name("listing")
    names = [f"{prefix}/{i:02d}" for i in range(30)]  # more than one ListResponse chunk
    for i, name in enumerate(names):
        await create_journal(client, name, labels={"parity": "even" if i % 2 == 0 else "odd"})

    assert _names(await list_journals(client, f"prefix={prefix}/")) == names
    odd = await list_journals(client, f"prefix={prefix}/, parity=odd")
    assert _names(odd) == names[1::2]
    assert odd[0].route.endpoints == [f"grpc://{client.address}"]

    spec = await get_journal(client, names[3])
    assert spec.name == names[3] and spec.fragment.compression_codec == pb.SNAPPY
    with pytest.raises(JournalNotFound):
        await get_journal(client, f"{prefix}/absent")


async def test_list_by_names_matches_as_any_selector(client: BrokerClient) -> None:
    # The broker looks only at the journals a selector names: the result must be what
    # matching every journal gives, with the selector's other terms applied too.
    prefix = unique_name("named")
    names = [f"{prefix}/{i}" for i in range(4)]
    for i, name in enumerate(names):
        await create_journal(client, name, labels={"parity": "even" if i % 2 == 0 else "odd"})
    chosen = f"{names[3]}, {names[0]}, {names[0]}, {prefix}/absent"
    assert _names(await list_journals(client, f"name in ({chosen})")) == [names[0], names[3]]
    assert _names(await list_journals(client, f"name in ({chosen}), parity=odd")) == [names[3]]
    assert _names(await list_journals(client, f"name in ({chosen}), parity!=odd")) == [names[0]]
    assert _names(await list_journals(client, f"name={names[1]}")) == [names[1]]
    # Relabelled: the next List matches the new labels, not what it matched before.
    [current] = await list_journals(client, f"name={names[0]}")
    spec = pb.JournalSpec()
    spec.CopyFrom(current.spec)
    spec.labels.CopyFrom(pb.LabelSet(labels=[pb.Label(name="parity", value="odd")]))
    await apply_journals(client, [pb.ApplyRequest.Change(
        expect_mod_revision=current.mod_revision, upsert=spec)])
    assert _names(await list_journals(client, f"name in ({chosen}), parity=odd")) == [
        names[0], names[3]]


async def test_apply_in_batches(client: BrokerClient) -> None:
    prefix = unique_name("apply")
    template = await create_journal(client, f"{prefix}/template")
    changes = []
    for i in range(5):
        spec = pb.JournalSpec()
        spec.CopyFrom(template)
        spec.name = f"{prefix}/batch-{i}"
        changes.append(pb.ApplyRequest.Change(expect_mod_revision=0, upsert=spec))
    response = await apply_journals_in_batches(client, changes, 2)
    assert response.status == pb.OK
    assert len(await list_journals(client, f"prefix={prefix}/")) == 6
    with pytest.raises(EtcdTransactionFailed):  # they exist now: "create" is stale
        await apply_journals_in_batches(client, changes, 0)


async def test_list_fragments_follows_pages(client: BrokerClient) -> None:
    journal = unique_name("fragments")
    await create_journal(client, journal, length=1024)
    for i in range(5):
        await append_bytes(client, journal, bytes([97 + i]) * 1100)  # each append rolls
    listed = await list_fragments(client, journal, page_limit=2)
    spans = [(f.spec.begin, f.spec.end) for f in listed.fragments]
    assert spans == [(1100 * i, 1100 * (i + 1)) for i in range(5)]
    assert listed.next_page_token == 0
    # Mod-time windows: nothing was modified before the epoch's first second.
    assert not (await list_fragments(client, journal, end_mod_time=1)).fragments


@pytest.mark.parametrize("watch", [True, False])
async def test_polled_list_sees_new_journals(client: BrokerClient, watch: bool) -> None:
    prefix = unique_name("polled")
    await create_journal(client, f"{prefix}/a")
    async with PolledList(client, f"prefix={prefix}/", interval=0.2, watch=watch) as polled:
        assert _names(polled.current) == [f"{prefix}/a"]
        updates = aiter(polled)
        assert _names(await anext(updates)) == [f"{prefix}/a"]
        await create_journal(client, f"{prefix}/b")
        seen = await asyncio.wait_for(anext(updates), 5)
        assert _names(seen) == [f"{prefix}/a", f"{prefix}/b"]
