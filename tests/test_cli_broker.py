"""`streamkit broker serve` as a user runs it: startup errors and structured logs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.brokerproc import BrokerProcess, free_port


def _serve(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "streamkit.cli.main", "broker", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def test_port_in_use_is_one_clear_line(broker_proc: BrokerProcess, tmp_path: Path) -> None:
    result = _serve("--data-dir", str(tmp_path / "other"), "--port", str(broker_proc.port))
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert f"cannot listen on 127.0.0.1:{broker_proc.port}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # (no gRPC core line)
    # An HTTP port taken (here: the gRPC one): one line too, not a finalizer's traceback.
    port = str(free_port())
    result = _serve("--data-dir", str(tmp_path / "third"), "--port", port, "--http-port", port)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"Error: broker could not start: cannot listen on 127.0.0.1:{port} for HTTP: "
        "Address already in use"], result.stderr


def test_bad_keyspace_url_is_one_clear_line(tmp_path: Path) -> None:
    result = _serve("--data-dir", str(tmp_path), "--port", "1", "--keyspace", "mystery://x")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "mystery://x" in result.stderr


def test_json_logs_are_one_object_per_line(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "broker", extra_args=["--log-format", "json"]).start()
    assert broker.terminate() == 0
    lines = [json.loads(line) for line in broker.log().splitlines() if line.strip()]
    assert any(entry["msg"] == "broker stopped" for entry in lines)
    assert all({"ts", "level", "logger", "msg"} <= entry.keys() for entry in lines)


def test_advertise_names_the_broker_in_routes(tmp_path: Path) -> None:
    """`--advertise HOST`: routes name the broker by the host clients reach it by, and the
    HTTP gateway answers that name."""
    import urllib.request

    from tests import wire

    broker = BrokerProcess(tmp_path / "broker",
                           extra_args=["--advertise", "broker.example"]).start()
    try:
        journals = wire.stub(broker.address)
        wire.create(journals, wire.spec("advertised/one"))
        _, metadata = wire.read(journals, "advertised/one", block=False)
        route = metadata[0].header.route
        assert list(route.endpoints) == [f"grpc://broker.example:{broker.port}"], route
        request = urllib.request.Request(f"{broker.http_url}/advertised/one", b"hi\n",
                                         headers={"Host": f"broker.example:{broker.port + 1}"},
                                         method="PUT")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 204
    finally:
        broker.kill()


def test_sigusr1_prints_every_threads_stack_and_serving_goes_on(
        broker_proc: BrokerProcess) -> None:
    """`kill -USR1` on a streamkit process (here the broker) writes where each of its threads
    is to its log, for a process that seems to hang; it keeps serving."""
    import signal
    import socket
    import time

    assert broker_proc.proc is not None
    before = broker_proc.log_path.read_text()
    broker_proc.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    dump = ""
    wanted = ("the stacks of its", "Thread MainThread", "[current thread",
              "asyncio/base_events.py")  # the serving loop's thread, interrupted in asyncio
    while not all(w in dump for w in wanted) and time.monotonic() < deadline:
        time.sleep(0.05)
        dump = broker_proc.log_path.read_text()[len(before):]
    assert "the stacks of its" in dump, "no stacks in the log"
    assert all(w in dump for w in wanted), dump
    assert broker_proc.proc.poll() is None
    with socket.create_connection(("127.0.0.1", broker_proc.port), timeout=5):
        pass  # still accepting
