"""The committed generated code must match what the .proto files produce."""

import importlib.util
import sys
from pathlib import Path

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
