"""Wire-level helpers for broker tests: plain synchronous gRPC stubs, as any Gazette peer uses."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import grpc
from google.protobuf.duration_pb2 import Duration

from streamkit.protocol import pb, pb_grpc
from tests.waiting import wait_until  # noqa: F401 (the broker tests' wire.wait_until)


def stub(address: str) -> pb_grpc.JournalStub:
    """A stub on a channel of its own. Its own subchannels too: by default channels to the
    same address share them, so a stub made just after a broker restart would inherit the
    reconnect backoff of a stub that saw the broker die, and fail fast with its error."""
    channel = grpc.insecure_channel(
        address, options=[("grpc.max_receive_message_length", 64 << 20),
                          ("grpc.use_local_subchannel_pool", 1)]
    )
    return pb_grpc.JournalStub(channel)


def spec(name: str, length: int = 1 << 20, codec: int = pb.SNAPPY,
         stores: Iterable[str] = ("file:///",), labels: dict[str, str] | None = None,
         flags: int = 0, flush_seconds: int = 0) -> pb.JournalSpec:
    fragment = pb.JournalSpec.Fragment(
        length=length, compression_codec=codec, stores=list(stores),
        refresh_interval=Duration(seconds=1),
    )
    if flush_seconds:
        fragment.flush_interval.CopyFrom(Duration(seconds=flush_seconds))
    label_set = pb.LabelSet(labels=[pb.Label(name=k, value=v)
                                    for k, v in sorted((labels or {}).items())])
    return pb.JournalSpec(name=name, replication=1, labels=label_set, fragment=fragment,
                          flags=flags)


def create(journals: pb_grpc.JournalStub, *specs: pb.JournalSpec) -> pb.ApplyResponse:
    changes = [pb.ApplyRequest.Change(expect_mod_revision=0, upsert=s) for s in specs]
    response = journals.Apply(pb.ApplyRequest(changes=changes))
    assert response.status == pb.OK, pb.Status.Name(response.status)
    return response


def update(journals: pb_grpc.JournalStub, spec: pb.JournalSpec) -> pb.ApplyResponse:
    """Replace an existing journal's spec (at its current revision)."""
    selector = pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="name",
                                                                      value=spec.name)]))
    (listed,) = next(iter(journals.List(pb.ListRequest(selector=selector)))).journals
    change = pb.ApplyRequest.Change(expect_mod_revision=listed.mod_revision, upsert=spec)
    response = journals.Apply(pb.ApplyRequest(changes=[change]))
    assert response.status == pb.OK, pb.Status.Name(response.status)
    return response


def delete(journals: pb_grpc.JournalStub, name: str) -> pb.ApplyResponse:
    """Delete an existing journal (at its current revision)."""
    selector = pb.LabelSelector(include=pb.LabelSet(labels=[pb.Label(name="name", value=name)]))
    (listed,) = next(iter(journals.List(pb.ListRequest(selector=selector)))).journals
    change = pb.ApplyRequest.Change(expect_mod_revision=listed.mod_revision, delete=name)
    response = journals.Apply(pb.ApplyRequest(changes=[change]))
    assert response.status == pb.OK, pb.Status.Name(response.status)
    return response


def append_requests(first: pb.AppendRequest, chunks: Iterable[bytes],
                    commit: bool = True) -> Iterator[pb.AppendRequest]:
    yield first
    for chunk in chunks:
        yield pb.AppendRequest(content=chunk)
    if commit:
        yield pb.AppendRequest()


def append(journals: pb_grpc.JournalStub, journal: str, *chunks: bytes,
           **params) -> pb.AppendResponse:
    first = pb.AppendRequest(journal=journal, **params)
    return journals.Append(append_requests(first, chunks))


def read(journals: pb_grpc.JournalStub, journal: str, offset: int = 0, end: int = 0,
         **params) -> tuple[bytes, list[pb.ReadResponse]]:
    """Read [offset, end) without blocking; returns the content and the metadata messages."""
    request = pb.ReadRequest(journal=journal, offset=offset, end_offset=end, **params)
    content, metadata = bytearray(), []
    for response in journals.Read(request):
        if response.content:
            content += response.content
        else:
            metadata.append(response)
    return bytes(content), metadata


def fragments(journals: pb_grpc.JournalStub, journal: str, **params) -> list[pb.Fragment]:
    response = journals.ListFragments(pb.FragmentsRequest(journal=journal, **params))
    assert response.status == pb.OK
    return [f.spec for f in response.fragments]
