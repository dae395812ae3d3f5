"""The committed generated code must match what the .proto files produce."""

import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protocol", ROOT / "scripts/gen_protocol.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_protocol"] = module
    spec.loader.exec_module(module)
    return module


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    gen = _load_generator()
    gen.generate(tmp_path)
    fresh = sorted(tmp_path.rglob("*_pb2*.py*"))
    assert fresh, "protoc produced nothing"
    for path in fresh:
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run scripts/gen_protocol.py"
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run scripts/gen_protocol.py"
        )


def test_service_and_field_numbers_match_gazette() -> None:
    """Spot-check the wire identity that Gazette peers depend on."""
    from streamkit.protocol import pb

    service = pb.DESCRIPTOR.services_by_name["Journal"]
    assert service.full_name == "protocol.Journal"
    assert service.methods_by_name["List"].server_streaming
    assert service.methods_by_name["Append"].client_streaming
    append = pb.AppendRequest.DESCRIPTOR.fields_by_name
    assert (append["content"].number, append["offset"].number) == (4, 5)
    assert pb.ReadRequest.DESCRIPTOR.fields_by_name["begin_mod_time"].number == 8
    assert pb.ListResponse.Journal.DESCRIPTOR.fields_by_name["create_revision"].number == 4
    assert pb.Status.Value("REGISTER_MISMATCH") == 13


def test_consumer_checkpoint_numbers_match_gazette() -> None:
    from streamkit.protocol import consumer_pb2 as consumer

    assert consumer.DESCRIPTOR.package == "consumer"
    checkpoint = consumer.Checkpoint.DESCRIPTOR.fields_by_name
    assert (checkpoint["sources"].number, checkpoint["ack_intents"].number) == (1, 2)
    state = consumer.Checkpoint.ProducerState.DESCRIPTOR.fields_by_name
    assert state["last_ack"].type == state["last_ack"].TYPE_FIXED64
    assert consumer.ShardSpec.DESCRIPTOR.fields_by_name["read_channel_size"].number == 13
    assert consumer.ReplicaStatus.Code.Value("FAILED") == 400


def test_consumer_shard_service_numbers_match_gazette() -> None:
    """The Shard service, checked against consumer/protocol/protocol.proto of Gazette."""
    from streamkit.protocol import consumer_pb2 as consumer

    service = consumer.DESCRIPTOR.services_by_name["Shard"]
    assert service.full_name == "consumer.Shard"
    assert list(service.methods_by_name) == ["Stat", "List", "Apply", "GetHints", "Unassign"]
    assert not any(m.client_streaming or m.server_streaming for m in service.methods)
    assert service.methods_by_name["GetHints"].output_type.full_name == "consumer.GetHintsResponse"
    assert consumer.Status.values() == [0, 1, 2, 3, 4, 5]
    assert consumer.Status.Name(4) == "ETCD_TRANSACTION_FAILED"

    def numbers(message: Any) -> dict[str, int]:
        return {f.name: f.number for f in message.DESCRIPTOR.fields}

    assert numbers(consumer.ListRequest) == {"selector": 1, "extension": 100}
    assert numbers(consumer.ListResponse.Shard) == {
        "spec": 1,
        "mod_revision": 2,
        "route": 3,
        "status": 4,
        "create_revision": 5,
    }
    change = consumer.ApplyRequest.Change.DESCRIPTOR.fields_by_name
    assert change["delete"].number == 3
    assert change["primary_hints"].number == 4
    assert change["primary_hints"].message_type.full_name == "recoverylog.FSMHints"
    assert numbers(consumer.StatResponse) == {
        "status": 1,
        "header": 2,
        "read_through": 3,
        "publish_at": 4,
        "extension": 100,
    }
    assert consumer.StatRequest.DESCRIPTOR.fields_by_name["header"].message_type.full_name == (
        "protocol.Header"
    )
    hints = consumer.GetHintsResponse.DESCRIPTOR.fields_by_name
    assert (hints["primary_hints"].number, hints["backup_hints"].number) == (3, 4)
    assert numbers(consumer.UnassignRequest) == {"shards": 1, "only_failed": 2, "dry_run": 3}
    assert numbers(consumer.UnassignResponse) == {"status": 1, "shards": 2}
