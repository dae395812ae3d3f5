"""Property-based fuzz of the broker's gRPC and HTTP surfaces, against one real broker.

Random request fields, names, offsets, registers, selectors and bodies, as
a careless or hostile client would send them. Whatever arrives, the broker
answers with a protocol status or a client-error code (never UNKNOWN,
INTERNAL or an HTTP 5xx), keeps serving, and the data it acknowledged
before stays intact.
"""

from __future__ import annotations

import http.client
import urllib.parse
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from streamkit.protocol import pb
from tests import wire
from tests.brokerproc import BrokerProcess

JOURNAL = "fuzz/target"
KEPT = b"acknowledged before the fuzzing\n"
SERVER_FAULTS = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                 grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.DATA_LOSS}
FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

names = st.one_of(
    st.sampled_from([JOURNAL, "fuzz/other", "", "/", "a//b", "x/../y", "fuzz/target/"]),
    st.text(min_size=0, max_size=40),
    st.text(alphabet="ab/.-_%=+", min_size=1, max_size=600),
)
labels = st.lists(st.builds(pb.Label, name=st.text(max_size=12), value=st.text(max_size=12),
                            prefix=st.booleans()), max_size=3)
label_sets = st.builds(lambda ls: pb.LabelSet(labels=ls), labels)
selectors = st.builds(lambda i, e: pb.LabelSelector(include=i, exclude=e), label_sets, label_sets)
offsets = st.one_of(st.integers(-3, 200), st.integers(-(1 << 63), (1 << 63) - 1))


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    proc = BrokerProcess(tmp_path_factory.mktemp("fuzz") / "broker").start()
    journals = wire.stub(proc.address)
    wire.create(journals, wire.spec(JOURNAL), wire.spec("fuzz/other"))
    wire.append(journals, JOURNAL, KEPT)
    yield proc
    proc.kill()


def _call(fn, *args) -> None:
    """Make the call; a gRPC error is fine unless it is a server fault."""
    try:
        result = fn(*args)
        if hasattr(result, "__iter__") and not isinstance(result, (bytes, str)):
            for _ in result:
                pass
    except grpc.RpcError as error:
        assert error.code() not in SERVER_FAULTS, (error.code(), error.details())


def _still_serving(broker: BrokerProcess) -> None:
    journals = wire.stub(broker.address)
    assert broker.proc is not None and broker.proc.poll() is None, broker.log()[-3000:]
    assert wire.read(journals, JOURNAL, end=len(KEPT))[0] == KEPT


@FUZZ
@given(journal=names, offset=offsets, end=offsets, metadata_only=st.booleans(),
       do_not_proxy=st.booleans())
def test_read_requests(broker: BrokerProcess, journal: str, offset: int, end: int,
                       metadata_only: bool, do_not_proxy: bool) -> None:
    journals = wire.stub(broker.address)  # never blocking: a read at the head would wait
    request = pb.ReadRequest(journal=journal, offset=offset, end_offset=end, block=False,
                             metadata_only=metadata_only, do_not_proxy=do_not_proxy)
    _call(lambda: journals.Read(request, timeout=5))
    _still_serving(broker)


@FUZZ
@given(journal=names, offset=st.integers(-3, 100), check=st.none() | selectors,
       union=st.none() | label_sets, subtract=st.none() | label_sets,
       first_content=st.binary(max_size=8), chunks=st.lists(st.binary(max_size=64), max_size=4),
       stray=st.sampled_from(["none", "journal", "offset"]), commit=st.booleans())
def test_append_requests(broker: BrokerProcess, journal: str, offset: int,
                         check: pb.LabelSelector | None, union: pb.LabelSet | None,
                         subtract: pb.LabelSet | None, first_content: bytes,
                         chunks: list[bytes], stray: str, commit: bool) -> None:
    journals = wire.stub(broker.address)
    first = pb.AppendRequest(journal=journal, offset=offset, content=first_content)
    for field, value in (("check_registers", check), ("union_registers", union),
                         ("subtract_registers", subtract)):
        if value is not None:
            getattr(first, field).CopyFrom(value)

    def requests() -> Iterator[pb.AppendRequest]:
        yield first
        for chunk in chunks:
            yield pb.AppendRequest(content=chunk)
        if stray == "journal":
            yield pb.AppendRequest(journal=JOURNAL, content=b"x")
        elif stray == "offset":
            yield pb.AppendRequest(offset=5, content=b"x")
        if commit:
            yield pb.AppendRequest()

    _call(lambda: journals.Append(requests(), timeout=10))
    _still_serving(broker)


@FUZZ
@given(selector=selectors)
def test_list_requests(broker: BrokerProcess, selector: pb.LabelSelector) -> None:
    journals = wire.stub(broker.address)
    request = pb.ListRequest(selector=selector, watch=False)
    _call(lambda: journals.List(request, timeout=5))
    _still_serving(broker)


@FUZZ
@given(name=names, labels=label_sets, length=st.integers(-5, 1 << 40),
       stores=st.lists(st.text(max_size=30) | st.sampled_from(
           ["file:///", "file:///x/", "s3://b/", "gs://b/", "file:///../x/"]), max_size=2),
       expect=st.integers(-2, 5), delete=st.booleans())
def test_apply_requests(broker: BrokerProcess, name: str, labels: pb.LabelSet, length: int,
                        stores: list[str], expect: int, delete: bool) -> None:
    if name in (JOURNAL, "fuzz/other"):
        name = "fuzz/applied"  # keep the journals the other checks rely on
    spec = pb.JournalSpec(name=name, replication=1, labels=labels, fragment=pb.JournalSpec.Fragment(
        length=max(min(length, (1 << 63) - 1), -(1 << 63)), stores=stores,
        compression_codec=pb.SNAPPY))
    change = (pb.ApplyRequest.Change(delete=name, expect_mod_revision=expect) if delete
              else pb.ApplyRequest.Change(upsert=spec, expect_mod_revision=expect))
    journals = wire.stub(broker.address)
    _call(lambda: journals.Apply(pb.ApplyRequest(changes=[change]), timeout=5))
    _still_serving(broker)
    wire.append(journals, "fuzz/other", b"still appending\n")  # the watch still works


@FUZZ
@given(journal=names, offset=offsets, page=st.integers(-2, 20_000), begin=offsets, end=offsets)
def test_list_fragments_requests(broker: BrokerProcess, journal: str, offset: int, page: int,
                                 begin: int, end: int) -> None:
    journals = wire.stub(broker.address)
    request = pb.FragmentsRequest(journal=journal, next_page_token=max(offset, 0),
                                  page_limit=max(min(page, (1 << 31) - 1), -(1 << 31)),
                                  begin_mod_time=begin, end_mod_time=end)
    _call(lambda: journals.ListFragments(request, timeout=5))
    _still_serving(broker)


query_values = st.one_of(st.text(max_size=30), offsets.map(str),
                         st.integers(1 << 63, 1 << 70).map(str), st.sampled_from(["", "true"]))


@settings(FUZZ, max_examples=150)
@given(method=st.sampled_from(["GET", "HEAD", "PUT", "POST", "DELETE"]),
       path=st.one_of(st.sampled_from([JOURNAL, "fuzz/other", "no/such"]), names),
       query=st.dictionaries(
           st.sampled_from(["offset", "x"]), query_values, max_size=2),
       body=st.binary(max_size=256), host=st.sampled_from(["localhost", "x"]))
@example(method="GET", path=JOURNAL, query={"offset": str(1 << 70)}, body=b"", host="x")
@example(method="HEAD", path=JOURNAL, query={"offset": str(-(1 << 64))}, body=b"", host="x")
def test_http_requests(broker: BrokerProcess, method: str, path: str, query: dict[str, str],
                       body: bytes, host: str) -> None:
    query = {**query, "block": "false"}  # never tail: a GET of the head would wait
    target = "/" + urllib.parse.quote(path, safe="/") + "?" + urllib.parse.urlencode(query)
    connection = http.client.HTTPConnection("127.0.0.1", broker.port + 1, timeout=10)
    try:
        connection.request(method, target,
                           body=body if method in ("PUT", "POST") else None,
                           headers={"Host": host})
        response = connection.getresponse()
        response.read()
        assert response.status < 500 or response.status == 507, (method, target, response.status)
    finally:
        connection.close()
    _still_serving(broker)
