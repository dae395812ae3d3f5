"""A broker persisting to an S3-compatible store (moto on loopback) and reading back from it."""

from __future__ import annotations

import random
import urllib.request
from pathlib import Path

from streamkit.protocol import pb
from streamkit.protocol.codecs import open_decompressed
from tests import wire
from tests.brokerproc import BrokerProcess


def test_fragments_persist_to_s3_and_read_back(tmp_path: Path, s3_url: str) -> None:
    broker = BrokerProcess(tmp_path / "broker").start()  # inherits the test's AWS settings
    try:
        journals = wire.stub(broker.address)
        name = "s3/events"
        wire.create(journals, wire.spec(name, length=4096, codec=pb.GZIP_OFFLOAD_DECOMPRESSION,
                                        stores=[s3_url]))
        blocks = [random.Random(i).randbytes(700) + bytes(2000) for i in range(6)]
        for block in blocks:
            assert wire.append(journals, name, block).status == pb.OK
        expected = b"".join(blocks)
        remote = wire.wait_until(
            lambda: [f for f in wire.fragments(journals, name) if f.backing_store == s3_url]
        )
        # Through the broker, which decompresses what it reads from S3.
        content, metadata = wire.read(journals, name, offset=0, end=remote[0].end)
        assert content == expected[: remote[0].end]
        assert metadata[0].fragment.backing_store == s3_url
        # Directly, with the presigned URL the broker hands out under do_not_proxy.
        _, metadata = wire.read(journals, name, do_not_proxy=True)
        url = metadata[0].fragment_url
        assert url.startswith("http://127.0.0.1:")
        request = urllib.request.Request(url, headers={"Accept-Encoding": "identity"})
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["Content-Encoding"] == "gzip"
            direct = open_decompressed(response, pb.GZIP).read()
        fragment = metadata[0].fragment
        assert direct == expected[fragment.begin : fragment.end]
        # After a restart the index is rebuilt from the S3 listing alone.
        broker.kill()
        broker.start()
        journals = wire.stub(broker.address)
        assert wire.read(journals, name, offset=0, end=remote[0].end)[0] == (
            expected[: remote[0].end]
        )
    finally:
        broker.kill()
