"""Gazette's wire rules (streamkit.protocol.conformance): each rule on good and bad messages,
naming the field; and a real broker's and a real member's responses pass them all."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from streamkit.auth import open_channel
from streamkit.protocol import consumer_pb, pb, pb_grpc
from streamkit.protocol import consumer_pb2_grpc as consumer_grpc
from streamkit.protocol import recoverylog_pb2 as recoverylog_pb
from streamkit.protocol.conformance import NonConformant, check, go_clean_path, problems_of
from streamkit.protocol.labels import label_set
from streamkit.protocol.response_checks import RESPONSE_CHECKERS, response_checkers
from tests.brokerproc import BrokerProcess


def _header(**route: object) -> pb.Header:
    return pb.Header(
        process_id=pb.ProcessSpec.ID(zone="local", suffix="broker-1"),
        route=pb.Route(**route) if route else pb.Route(primary=-1),
        etcd=pb.Header.Etcd(cluster_id=1, member_id=2, revision=3, raft_term=4),
    )


def _spec(name: str = "app/words/part-000") -> pb.JournalSpec:
    spec = pb.JournalSpec(name=name, replication=1,
                          labels=label_set(("content-type", "application/x-ndjson")))
    spec.fragment.length = 1 << 20
    spec.fragment.compression_codec = pb.SNAPPY
    spec.fragment.stores.append("file:///")
    spec.fragment.refresh_interval.FromSeconds(300)
    return spec


def _fragment(**fields: object) -> pb.Fragment:
    values: dict[str, object] = {"journal": "app/words/part-000", "begin": 0, "end": 10,
                                 "compression_codec": pb.SNAPPY}
    values.update(fields)
    return pb.Fragment(**values)


def _only(message: object, path: str) -> str:
    """The one problem of `message`, which must name `path`."""
    found = problems_of(message)  # type: ignore[arg-type]
    assert len(found) == 1, found
    assert found[0].startswith(f"{path}: "), found
    return found[0]


# --- headers, routes, process ids ---------------------------------------------------------------


def test_a_good_header_and_response_pass() -> None:
    assert problems_of(_header()) == []
    assert problems_of(pb.ApplyResponse(status=pb.OK, header=_header())) == []
    check(pb.ApplyResponse(header=_header()))


def test_process_id_suffix_is_4_to_128_token_characters() -> None:
    header = _header()
    header.process_id.suffix = "vm"
    assert "4 to 128" in _only(header, "process_id.suffix")
    header.process_id.suffix = "x" * 129
    _only(header, "process_id.suffix")
    header.process_id.suffix = "has space"
    _only(header, "process_id.suffix")
    header.process_id.suffix = "host.example-1_2+3/4"
    assert problems_of(header) == []


def test_process_id_zone_is_1_to_32_token_characters() -> None:
    header = _header()
    header.process_id.zone = "z" * 33
    _only(header, "process_id.zone")
    header.process_id.zone = "us:east"
    _only(header, "process_id.zone")


def test_an_empty_process_id_is_allowed_in_a_header() -> None:
    header = _header()
    header.ClearField("process_id")
    assert problems_of(header) == []


def test_an_unrouted_header_has_primary_minus_one() -> None:
    header = _header()
    header.route.primary = 0  # the proto default: not a valid unrouted route
    assert "-1" in _only(header, "route.primary")


def test_route_members_are_sorted_and_primary_indexes_one() -> None:
    a = pb.ProcessSpec.ID(zone="local", suffix="member-a")
    b = pb.ProcessSpec.ID(zone="local", suffix="member-b")
    assert problems_of(pb.Route(members=[a, b], primary=1)) == []
    _only(pb.Route(members=[b, a], primary=0), "members[1]")
    _only(pb.Route(members=[a, a], primary=0), "members[1]")
    _only(pb.Route(members=[a, b], primary=2), "primary")
    _only(pb.Route(members=[a, b], primary=-2), "primary")


def test_route_endpoints_are_one_per_member_and_absolute_urls() -> None:
    a = pb.ProcessSpec.ID(zone="local", suffix="member-a")
    b = pb.ProcessSpec.ID(zone="local", suffix="member-b")
    good = pb.Route(members=[a, b], primary=0, endpoints=["grpc://127.0.0.1:8080", ""])
    assert problems_of(good) == []
    _only(pb.Route(members=[a, b], primary=0, endpoints=["grpc://h:1"]), "endpoints")
    _only(pb.Route(members=[a], primary=0, endpoints=["127.0.0.1:8080"]), "endpoints[0]")
    _only(pb.Route(members=[a], primary=0, endpoints=["http:///path"]), "endpoints[0]")
    _only(pb.Route(members=[a], primary=0, endpoints=["http://h:port"]), "endpoints[0]")


def test_header_etcd_fields_are_all_set() -> None:
    header = _header()
    header.etcd.revision = 0
    _only(header, "etcd.revision")
    header = _header()
    header.etcd.cluster_id = 0
    _only(header, "etcd.cluster_id")
    header = _header()
    header.etcd.raft_term = 0
    _only(header, "etcd.raft_term")


def test_headed_responses_need_their_header() -> None:
    found = problems_of(pb.ListResponse(status=pb.OK))
    assert "header: is required" in found
    assert problems_of(consumer_pb.StatResponse(header=_header())) == []
    assert "header: is required" in problems_of(consumer_pb.ApplyResponse())


def test_statuses_are_known_values() -> None:
    _only(pb.ApplyResponse(status=99, header=_header()), "status")
    _only(consumer_pb.UnassignResponse(status=42), "status")
    assert problems_of(consumer_pb.UnassignResponse(status=consumer_pb.SHARD_NOT_FOUND)) == []


# --- labels, journal names, specs --------------------------------------------------------------


def test_label_sets_are_sorted_unique_and_well_formed() -> None:
    assert problems_of(label_set(("a1", "x"), ("a1", "y"), ("b2", ""))) == []
    unsorted = pb.LabelSet(labels=[pb.Label(name="bb", value="1"), pb.Label(name="aa")])
    _only(unsorted, "labels[1]")
    both = pb.LabelSet(labels=[pb.Label(name="aa"), pb.Label(name="aa", value="1")])
    assert "empty and a non-empty" in _only(both, "labels[1]")
    _only(pb.LabelSet(labels=[pb.Label(name="a")]), "labels[0].name")
    _only(pb.LabelSet(labels=[pb.Label(name="aa", value="has space")]), "labels[0].value")
    _only(pb.LabelSet(labels=[pb.Label(name="aa", value="v", prefix=True)]), "labels[0].prefix")


@pytest.mark.parametrize("name", ["a/b/c", "logs/clicks=1/part%20", "ns:topic/p-1", "../up/x"])
def test_journal_names_gazette_accepts(name: str) -> None:
    assert problems_of(_spec(name)) == []


@pytest.mark.parametrize("name", ["abc", "/abs/path", "a//b", "a/./b", "a/b/", "a/b/..", "a b/c",
                                  "x" * 513])
def test_journal_names_gazette_refuses(name: str) -> None:
    _only(_spec(name), "name")


def test_go_clean_path_matches_go() -> None:
    for path, cleaned in [("", "."), ("a/../..", ".."), ("/../a", "/a"), ("a//b/", "a/b"),
                          ("./a", "a"), ("/", "/")]:
        assert go_clean_path(path) == cleaned


def test_journal_spec_rules() -> None:
    assert problems_of(_spec()) == []
    cases = [
        ("replication", lambda s: setattr(s, "replication", 0)),
        ("replication", lambda s: setattr(s, "replication", 6)),
        ("fragment.length", lambda s: setattr(s.fragment, "length", 1000)),
        ("fragment.compression_codec", lambda s: setattr(s.fragment, "compression_codec", 0)),
        ("fragment.stores[0]", lambda s: s.fragment.stores.__setitem__(0, "ftp://h/x/")),
        ("fragment.stores[0]", lambda s: s.fragment.stores.__setitem__(0, "s3://bucket/no-slash")),
        ("fragment.stores[0]", lambda s: s.fragment.stores.__setitem__(0, "file://host/")),
        ("fragment.refresh_interval", lambda s: s.fragment.refresh_interval.FromSeconds(0)),
        ("fragment.flush_interval", lambda s: s.fragment.flush_interval.FromSeconds(30)),
        ("fragment.path_postfix_template",
         lambda s: setattr(s.fragment, "path_postfix_template", "{{ .Spool")),
        ("flags", lambda s: setattr(s, "flags", 3)),
        ("max_append_rate", lambda s: setattr(s, "max_append_rate", -1)),
        ("labels", lambda s: s.labels.CopyFrom(label_set(("name", "x")))),
        ("labels", lambda s: s.labels.CopyFrom(label_set(("content-type", "no-slash")))),
        ("labels", lambda s: s.labels.CopyFrom(
            label_set(("content-type", "a/b"), ("content-type", "c/d")))),
        ("labels", lambda s: s.labels.CopyFrom(
            label_set(("app.gazette.dev/message-type", "Word")))),
    ]
    for path, spoil in cases:
        spec = _spec()
        spoil(spec)
        _only(spec, path)
    offload = _spec()
    offload.fragment.compression_codec = pb.GZIP_OFFLOAD_DECOMPRESSION
    _only(offload, "fragment.stores[0]")


def test_list_response_journals() -> None:
    good = pb.ListResponse.Journal(spec=_spec(), mod_revision=3, route=pb.Route(primary=-1))
    assert problems_of(pb.ListResponse(header=_header(), journals=[good])) == []
    bad = pb.ListResponse.Journal(spec=_spec(), mod_revision=0)
    found = problems_of(pb.ListResponse(header=_header(), journals=[bad]))
    paths = [p.split(":")[0] for p in found]
    assert paths == ["journals[0].mod_revision", "journals[0].route.primary"]


# --- fragments, reads, appends, replication -------------------------------------------------


def test_fragment_rules() -> None:
    assert problems_of(_fragment(path_postfix="date=2024-01-01")) == []
    assert "must not exceed end" in _only(_fragment(begin=11), "begin")
    _only(_fragment(compression_codec=9), "compression_codec")
    _only(_fragment(path_postfix="/abs"), "path_postfix")
    _only(_fragment(journal="no"), "journal")


def test_read_responses() -> None:
    metadata = pb.ReadResponse(status=pb.OK, header=_header(), offset=5, write_head=20,
                               fragment=_fragment(), fragment_url="file:///x/y.sz")
    assert problems_of(metadata) == []
    assert problems_of(pb.ReadResponse(content=b"abc")) == []
    assert problems_of(pb.ReadResponse(status=pb.OFFSET_NOT_YET_AVAILABLE, offset=7,
                                       write_head=7)) == []
    _only(pb.ReadResponse(content=b"abc", write_head=3), "write_head")
    _only(pb.ReadResponse(content=b"abc", status=pb.NOT_ALLOWED), "status")
    _only(pb.ReadResponse(content=b"abc", header=_header()), "header")
    _only(pb.ReadResponse(offset=10, write_head=20, fragment=_fragment()), "offset")
    _only(pb.ReadResponse(offset=5, write_head=9, fragment=_fragment()), "write_head")
    _only(pb.ReadResponse(offset=5), "offset")
    _only(pb.ReadResponse(fragment_url="file:///x"), "fragment_url")
    _only(pb.ReadResponse(write_head=-1), "write_head")


def test_append_responses() -> None:
    ok = pb.AppendResponse(status=pb.OK, header=_header(), commit=_fragment(),
                           registers=pb.LabelSet())
    assert problems_of(ok) == []
    no_commit = pb.AppendResponse(status=pb.OK, header=_header(), registers=pb.LabelSet())
    _only(no_commit, "commit")
    _only(pb.AppendResponse(status=pb.REGISTER_MISMATCH, header=_header()), "registers")
    assert problems_of(pb.AppendResponse(status=pb.JOURNAL_NOT_FOUND, header=_header())) == []


def test_replicate_responses() -> None:
    assert problems_of(pb.ReplicateResponse(status=pb.OK)) == []
    _only(pb.ReplicateResponse(status=pb.OK, header=_header()), "header")
    assert problems_of(pb.ReplicateResponse(status=pb.WRONG_ROUTE, header=_header())) == []
    mismatch = pb.ReplicateResponse(status=pb.PROPOSAL_MISMATCH, fragment=_fragment())
    _only(mismatch, "registers")
    _only(pb.ReplicateResponse(status=pb.OK, fragment=_fragment()), "fragment")


def test_fragments_responses() -> None:
    item = pb.FragmentsResponse._Fragment(spec=_fragment(), signed_url="s3://b/k?sig=1")
    assert problems_of(pb.FragmentsResponse(header=_header(), fragments=[item])) == []
    item.spec.journal = "x"
    _only(pb.FragmentsResponse(header=_header(), fragments=[item]), "fragments[0].spec.journal")


# --- shards ---------------------------------------------------------------------------------------


def _shard(**fields: object) -> consumer_pb.ShardSpec:
    values: dict[str, object] = {"id": "shard-000", "recovery_log_prefix": "recovery/app",
                                 "hint_prefix": "/app/hints"}
    spec = consumer_pb.ShardSpec(**{**values, **fields})
    spec.sources.add(journal="app/words/part-000")
    spec.max_txn_duration.FromSeconds(1)
    return spec


def test_shard_spec_rules() -> None:
    assert problems_of(_shard()) == []
    assert problems_of(consumer_pb.ShardSpec(id="a=b%c:d", max_txn_duration={"seconds": 1})) == []
    _only(_shard(id="abc"), "id")
    _only(_shard(hint_prefix="/app/hints/"), "hint_prefix")
    _only(_shard(hint_prefix="relative"), "hint_prefix")
    _only(_shard(hint_backups=-1), "hint_backups")
    _only(_shard(labels=label_set(("id", "x"))), "labels")
    no_log = consumer_pb.ShardSpec(id="shard-000", hint_prefix="/h",
                                   max_txn_duration={"seconds": 1})
    _only(no_log, "hint_prefix")
    zero_txn = _shard()
    zero_txn.max_txn_duration.FromSeconds(0)
    _only(zero_txn, "max_txn_duration")
    twice = _shard()
    twice.sources.add(journal="app/words/part-000")
    _only(twice, "sources[1]")
    negative = _shard()
    negative.sources[0].min_offset = -1
    _only(negative, "sources[0].min_offset")


def test_replica_status_failed_iff_errors() -> None:
    Code = consumer_pb.ReplicaStatus
    assert problems_of(Code(code=Code.FAILED, errors=["boom"])) == []
    _only(Code(code=Code.FAILED), "errors")
    _only(Code(code=Code.PRIMARY, errors=["boom"]), "code")
    _only(Code(code=7), "code")


def test_shard_list_has_a_status_per_route_member() -> None:
    member = pb.ProcessSpec.ID(zone="local", suffix="member-a")
    shard = consumer_pb.ListResponse.Shard(
        spec=_shard(), mod_revision=2, route=pb.Route(members=[member], primary=0),
        status=[consumer_pb.ReplicaStatus(code=consumer_pb.ReplicaStatus.PRIMARY)])
    assert problems_of(consumer_pb.ListResponse(header=_header(), shards=[shard])) == []
    del shard.status[:]
    _only(consumer_pb.ListResponse(header=_header(), shards=[shard]), "shards[0].status")


def test_stat_offsets_name_valid_journals() -> None:
    good = consumer_pb.StatResponse(header=_header(), read_through={"app/words/part-000": 5})
    assert problems_of(good) == []
    _only(consumer_pb.StatResponse(header=_header(), publish_at={"app/out": -1}),
          "publish_at['app/out']")
    _only(consumer_pb.StatResponse(header=_header(), read_through={"/bad": 1}),
          "read_through['/bad']")


def test_hints_segments() -> None:
    hints = recoverylog_pb.FSMHints(log="recovery/app/shard-000")
    node = hints.live_nodes.add(fnode=1)
    node.segments.add(author=7, first_seq_no=1, last_seq_no=4, first_offset=0, last_offset=90)
    response = consumer_pb.GetHintsResponse(header=_header())
    response.primary_hints.hints.CopyFrom(hints)
    assert problems_of(response) == []
    node.segments[0].log = hints.log
    response.backup_hints.add().hints.CopyFrom(hints)
    _only(response, "backup_hints[0].hints.live_nodes[0].segments[0].log")
    node.segments[0].log = ""
    node.segments[0].author = 0
    _only(hints, "live_nodes[0].segments[0].author")


def test_check_raises_naming_every_problem() -> None:
    with pytest.raises(NonConformant) as raised:
        check(pb.ApplyResponse(status=77))
    assert "protocol.ApplyResponse" in str(raised.value)
    assert "status" in str(raised.value) and "header.etcd.revision" in str(raised.value)
    assert len(raised.value.problems) > 2


def test_checks_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMKIT_CHECK_RESPONSES", "0")
    assert response_checkers() == []
    monkeypatch.setenv("STREAMKIT_CHECK_RESPONSES", "1")
    assert [type(c) for c in response_checkers()] == list(RESPONSE_CHECKERS)


# --- the interceptor, against a server that answers wrongly -----------------------------------


class _BadJournals(pb_grpc.JournalServicer):
    async def Apply(self, request: object, context: object) -> pb.ApplyResponse:
        return pb.ApplyResponse(status=pb.OK)  # no header

    async def List(self, request: object, context: object):  # type: ignore[no-untyped-def]
        yield pb.ListResponse(header=_header())
        yield pb.ListResponse(header=_header(primary=0))  # an unrouted route with primary 0


async def test_the_interceptor_refuses_bad_responses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMKIT_CHECK_RESPONSES", "1")
    server = grpc.aio.server()
    pb_grpc.add_JournalServicer_to_server(_BadJournals(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with open_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.JournalStub(channel)
            with pytest.raises(NonConformant, match="header: is required"):
                await stub.Apply(pb.ApplyRequest())
            call = stub.List(pb.ListRequest())
            first = await call.read()
            assert problems_of(first) == []
            with pytest.raises(NonConformant, match=r"header\.route\.primary"):
                await call.read()
    finally:
        await server.stop(None)


# --- real servers ---------------------------------------------------------------------------------


async def test_a_real_brokers_responses_conform(broker_proc: BrokerProcess) -> None:
    """Every RPC of a real broker process, checked explicitly (and by the interceptor)."""
    journal = "conformance/words/part-000"
    async with open_channel(broker_proc.address) as channel:
        stub = pb_grpc.JournalStub(channel)
        listed = [r async for r in stub.List(pb.ListRequest())]  # before any journal exists
        applied = await stub.Apply(pb.ApplyRequest(changes=[
            pb.ApplyRequest.Change(upsert=_spec(journal), expect_mod_revision=0)]))
        assert applied.status == pb.OK
        listed += [r async for r in stub.List(pb.ListRequest())]
        assert any(j.spec.name == journal for r in listed for j in r.journals)
        conflict = await stub.Apply(pb.ApplyRequest(changes=[
            pb.ApplyRequest.Change(upsert=_spec(journal), expect_mod_revision=0)]))
        call = stub.Append()
        await call.write(pb.AppendRequest(journal=journal))
        await call.write(pb.AppendRequest(content=b"hello\n"))
        await call.write(pb.AppendRequest())
        await call.done_writing()
        appended = await call
        assert appended.status == pb.OK
        read = [r async for r in stub.Read(pb.ReadRequest(journal=journal, offset=0,
                                                           block=False))]
        missing = [r async for r in stub.Read(pb.ReadRequest(journal="conformance/none"))]
        fragments = await stub.ListFragments(pb.FragmentsRequest(journal=journal))
        responses = [*listed, applied, conflict, appended, *read, *missing, fragments]
    for response in responses:
        assert problems_of(response) == [], response


async def test_a_real_members_responses_conform(broker_proc: BrokerProcess,
                                                tmp_path: Path) -> None:
    """A running app's member answers Stat, List, Apply, GetHints and Unassign conformantly."""
    from tests.e2e import AppView, copy_wordcount, run_app

    app = copy_wordcount(tmp_path / "wordcount")
    run = run_app(app, broker_proc.address, tmp_path / "run.log")
    try:
        async with AppView(app, broker_proc.address) as view:
            serving = await view.wait_serving(60)
            shard, endpoint = sorted(serving.items())[0]
            async with open_channel(endpoint.removeprefix("grpc://")) as channel:
                stub = consumer_grpc.ShardStub(channel)
                stat = await stub.Stat(consumer_pb.StatRequest(shard=shard))
                listed = await stub.List(consumer_pb.ListRequest())
                assert listed.shards
                spec = next(s for s in listed.shards if s.spec.id == shard)
                applied = await stub.Apply(consumer_pb.ApplyRequest(changes=[
                    consumer_pb.ApplyRequest.Change(upsert=spec.spec,
                                                    expect_mod_revision=spec.mod_revision)]))
                hints = await stub.GetHints(consumer_pb.GetHintsRequest(shard=shard))
                assert hints.status == consumer_pb.OK
                missing = await stub.GetHints(consumer_pb.GetHintsRequest(shard="shard-none"))
                unassigned = await stub.Unassign(
                    consumer_pb.UnassignRequest(shards=[shard], dry_run=True))
            responses = [stat, listed, applied, hints, missing, unassigned]
        for response in responses:
            assert problems_of(response) == [], response
    finally:
        run.stop()

