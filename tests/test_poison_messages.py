"""Poison messages: a source frame that doesn't decode, or one consume_message raises on.

Each source policy of streamkit.yaml (`on_undecodable`, `on_consume_error`: fail, skip,
dead-letter) against a real broker and runtime: `fail` fails the shard naming the message,
`skip` counts every other message exactly once with a warning and a metric, `dead-letter`
also leaves exactly one committed dead letter, even when the shard dies between consuming
the poison message and committing (in-process, and a `streamkit run` SIGKILLed).
"""

from __future__ import annotations

import base64
import logging
import pickle
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest
import yaml
from prometheus_client import REGISTRY

from streamkit.app.application import Application
from streamkit.app.config import (
    DEAD_LETTER,
    DEAD_LETTERS_LABEL,
    FAIL,
    ON_UNDECODABLE_LABEL,
    SKIP,
    STORE_LABEL,
    AppConfig,
    ConfigError,
)
from streamkit.app.member import Member
from streamkit.client import BrokerClient, write_head
from streamkit.client.append_service import AppendService
from streamkit.message.framing import MAX_ERRORS, FrameError, framing_for
from streamkit.message.framings.fixed import MAGIC
from streamkit.message.reader import ReadCommitted, ReadUncommitted
from streamkit.protocol import pb
from streamkit.testing import AppHarness, read_journals
from tests.brokerproc import BrokerProcess
from tests.e2e import (
    AppView,
    Feeder,
    cli,
    copy_wordcount,
    eventually,
    expected_counts,
    run_app,
    totals_of_updates,
)
from tests.test_run_e2e import _app_variant

JOURNAL = "events/part-000"
DEAD_LETTERS = "poison/dead-letters"
GARBAGE = b"not json\n"
POISON_ID = 99
SETTING = {"undecodable": "on_undecodable", "consume-error": "on_consume_error"}


# --- framings: which bad frames can be skipped --------------------------------------------


def test_bad_lines_are_skippable_frames() -> None:
    """A bad JSON line or CSV record is exactly one frame: its end and bytes are reported."""
    good = orjson.dumps({"a": 1}) + b"\n"
    decoder = framing_for("application/x-ndjson").new_decoder(JOURNAL, dict)
    assert len(decoder.feed(good + GARBAGE + good, 100)) == 2
    (error,) = decoder.errors
    assert (error.offset, error.end, error.frame) == (100 + len(good), 100 + len(good + GARBAGE),
                                                      GARBAGE)
    assert error.skippable

    record = b"not-a-uuid,x\r\n"
    decoder = framing_for("text/csv").new_decoder(JOURNAL, dict)
    assert decoder.feed(record, 7) == []
    (error,) = decoder.errors
    assert (error.offset, error.end, error.frame) == (7, 7 + len(record), record)


def test_a_fixed_frame_that_does_not_parse_is_not_skippable() -> None:
    """The fixed framing resynchronizes by scanning: it can't vouch for where a bad frame ends."""
    frame = MAGIC + (3).to_bytes(4, "little") + b"\xff\xff\xff"
    decoder = framing_for("application/x-protobuf-fixed").new_decoder(JOURNAL, pb.Label)
    decoder.feed(frame, 0)
    assert decoder.errors and not any(e.skippable for e in decoder.errors)


def test_on_error_sees_every_bad_frame_and_errors_pickle() -> None:
    decoder = framing_for("application/x-ndjson").new_decoder(JOURNAL, dict)
    seen: list[FrameError] = []
    decoder.on_error = seen.append  # type: ignore[attr-defined]
    decoder.feed(b"x\n" * (MAX_ERRORS + 5), 0)
    assert len(seen) == MAX_ERRORS + 5 and len(decoder.errors) == MAX_ERRORS
    copy = pickle.loads(pickle.dumps(seen[-1]))
    assert (copy.offset, copy.end, copy.frame, str(copy)) == (
        seen[-1].offset, seen[-1].end, b"x\n", str(seen[-1]))


# --- configuration ---------------------------------------------------------------------------


def _document(**source: Any) -> dict[str, Any]:
    return {"name": "poison", "application": "app:Tally",
            "sources": [{"topic": "events", "key": "id", **source}]}


def test_a_bad_policy_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError) as failed:
        AppConfig.parse(_document(on_undecodable="drop", on_consume_error="retry"))
    text = str(failed.value)
    assert "streamkit.yaml: sources[0].on_undecodable:" in text
    assert "streamkit.yaml: sources[0].on_consume_error:" in text
    assert "'fail', 'skip' or 'dead-letter'" in text and "'drop'" in text


def test_policies_reach_the_shard_specs_and_dead_letters_get_a_journal() -> None:
    plain = AppConfig.parse(_document())
    names = [label.name for label in plain.shard_specs()[0].labels.labels]
    assert names == ["app", STORE_LABEL]  # (no policy labels for the defaults)
    assert DEAD_LETTERS not in [spec.name for spec in plain.journal_specs()]

    config = AppConfig.parse(_document(on_undecodable=DEAD_LETTER, on_consume_error=SKIP))
    labels = {(lbl.name, lbl.value) for lbl in config.shard_specs()[0].labels.labels}
    assert (ON_UNDECODABLE_LABEL, "events:dead-letter") in labels
    assert (DEAD_LETTERS_LABEL, DEAD_LETTERS) in labels
    (spec,) = [spec for spec in config.journal_specs() if spec.name == DEAD_LETTERS]
    assert {(lbl.name, lbl.value) for lbl in spec.labels} == {
        ("content-type", "application/x-ndjson"), (DEAD_LETTERS_LABEL, "poison")}


# --- the runtime -------------------------------------------------------------------------------


class Tally(Application):
    """Counts each message's id. consume_message only tallies in memory, and raises on a
    poison message before that; the store changes in finalize_txn (as the template's app)."""

    store = "json"
    # finalize_txn of a transaction holding id "crash" appends what it published, then raises
    crash_once: ClassVar[bool] = False

    def __init__(self) -> None:
        self.pending: Counter[str] = Counter()

    def begin_txn(self, shard: Any, store: Any) -> None:
        self.pending = Counter()

    def consume_message(self, shard: Any, store: Any, envelope: Any, publisher: Any) -> None:
        if envelope.message.get("poison"):
            raise ValueError(f"cannot count {envelope.message['id']}")
        self.pending[str(envelope.message["id"])] += 1

    async def finalize_txn(self, shard: Any, store: Any, publisher: Any) -> None:
        if Tally.crash_once and "crash" in self.pending:
            Tally.crash_once = False
            await shard.appends.flush()  # the dead letter reaches the journal, uncommitted
            raise RuntimeError("injected crash between consume and commit")
        for key, n in self.pending.items():
            store.state[key] = store.state.get(key, 0) + n

    def query(self, shard: Any, store: Any, request: dict[str, Any]) -> Any:
        return dict(store.state)


class ProtoTally(Tally):
    message_type = pb.Label


def _app(tmp_path: Path, **source: Any) -> Path:
    folder = tmp_path / "poison"
    folder.mkdir()
    document = {**_document(**source), "transactions": {"max_duration": "200ms"}}
    (folder / "streamkit.yaml").write_text(yaml.safe_dump(document))
    return folder


async def _append(client: BrokerClient, data: bytes) -> None:
    async with AppendService(client) as service:
        await (await service.append(JOURNAL, data))


def _skipped(cause: str, policy: str) -> float:
    labels = {"shard": "shard-000", "journal": JOURNAL, "cause": cause, "policy": policy}
    return REGISTRY.get_sample_value("streamkit_shard_skipped_messages_total", labels) or 0.0


async def _letters(client: BrokerClient, kind: type = ReadUncommitted) -> list[dict[str, Any]]:
    """Dead letters of the app (the `kind` of reader decides: committed, or as written)."""
    return [m for m in await read_journals(client, [DEAD_LETTERS], kind) if "journal" in m]


@pytest.mark.parametrize("policy", [FAIL, SKIP, DEAD_LETTER])
@pytest.mark.parametrize("cause", ["undecodable", "consume-error"])
async def test_poison_message_policies(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                       cause: str, policy: str) -> None:
    """A poison message amid good ones: fail names it; skip and dead-letter pass over it once,
    logged and counted; dead-letter keeps it, readable committed."""
    async with AppHarness(_app(tmp_path, **{SETTING[cause]: policy}), app_class=Tally) as h:
        assert h.client is not None
        skipped = _skipped(cause, policy)
        await h.publish("events", [{"id": i} for i in range(10)])
        bad_at = await write_head(h.client, JOURNAL)
        if cause == "undecodable":
            await _append(h.client, GARBAGE)
        else:
            await h.publish("events", [{"id": POISON_ID, "poison": True}])
        await h.publish("events", [{"id": i} for i in range(10, 20)])

        if policy == FAIL:
            with pytest.raises(AssertionError) as failed:
                await h.wait_idle()
            error = str(failed.value)
            assert "shard shard-000 failed: transaction " in error
            if cause == "undecodable":
                assert f"bad frame in journal '{JOURNAL}' at offset {bad_at}: invalid JSON" in error
            else:
                assert f"ValueError: cannot count {POISON_ID}" in error
            return

        with caplog.at_level(logging.WARNING, logger="streamkit.app.txn"):
            await h.wait_idle()
        assert await h.query({}, shard="shard-000") == {str(i): 1 for i in range(20)}
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("shard-000" in w and f"message of {JOURNAL} at offset {bad_at}" in w
                   and f"({SETTING[cause]}: {policy})" in w for w in warnings), warnings
        assert _skipped(cause, policy) == skipped + 1

        if policy == DEAD_LETTER:
            (letter,) = await _letters(h.client, ReadCommitted)
            assert letter["journal"] == JOURNAL and letter["offset"] == bad_at
            assert letter["shard"] == "shard-000" and letter["cause"] == cause
            if cause == "undecodable":
                assert base64.b64decode(letter["raw"]) == GARBAGE
                assert letter["end"] == bad_at + len(GARBAGE)
                assert letter["error"].startswith("invalid JSON")
            else:
                assert letter["message"]["id"] == POISON_ID and letter["message"]["poison"]
                assert letter["error"] == f"ValueError: cannot count {POISON_ID}"


async def test_an_unskippable_frame_fails_whatever_the_policy(tmp_path: Path) -> None:
    """Garbage in a fixed-framing source has no known end: skip can't pass it, and says why."""
    folder = _app(tmp_path, on_undecodable=SKIP, content_type="application/x-protobuf-fixed")
    async with AppHarness(folder, app_class=ProtoTally) as h:
        assert h.client is not None
        await _append(h.client, b"garbage, not a frame")
        with pytest.raises(AssertionError) as failed:
            await h.wait_idle()
    error = str(failed.value)
    assert f"bad frame in journal '{JOURNAL}' at offset 0" in error
    assert "on_undecodable: skip can't pass it" in error


@pytest.mark.parametrize("cause", ["undecodable", "consume-error"])
async def test_dead_letter_exactly_once_across_a_crash_before_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cause: str
) -> None:
    """The transaction that dead-lettered a message dies before committing: its dead letter
    stays uncommitted, and the shard, started again, dead-letters the message once more and
    commits: one dead letter, read committed."""
    monkeypatch.setattr(Tally, "crash_once", True)
    folder = _app(tmp_path, **{SETTING[cause]: DEAD_LETTER})
    async with AppHarness(folder, app_class=Tally) as h:
        assert h.client is not None and h.member is not None
        await h.publish("events", [{"id": i} for i in range(10)])
        bad_at = await write_head(h.client, JOURNAL)
        # One append, so one transaction: the poison message, then one that makes it crash
        # (neither has a UUID: each is committed as it is).
        poison = GARBAGE if cause == "undecodable" else _line({"id": POISON_ID, "poison": True})
        await _append(h.client, poison + _line({"id": "crash"}))
        await h.publish("events", [{"id": i} for i in range(10, 20)])
        with pytest.raises(AssertionError, match="injected crash"):
            await h.wait_idle()
        assert len(await _letters(h.client)) == 1  # written, but never acknowledged
        assert await _letters(h.client, ReadCommitted) == []

        member = h.member
        await member.stop()
        h.member = Member(h.config, h.app_class, h.client, member.keyspace, member.options)
        await h.member.start()
        await h.wait_idle()

        expected = {str(i): 1 for i in range(20)} | {"crash": 1}
        assert await h.query({}, shard="shard-000") == expected
        copies = await _letters(h.client)
        assert len(copies) == 2 and {c["offset"] for c in copies} == {bad_at}
        (letter,) = await _letters(h.client, ReadCommitted)
        if cause == "undecodable":
            assert base64.b64decode(letter["raw"]) == GARBAGE
        else:
            assert letter["message"] == {"id": POISON_ID, "poison": True}


def _line(message: dict[str, Any]) -> bytes:
    return orjson.dumps(message) + b"\n"


HANGING = """
class Hanging(WordCount):
    async def consume_message(self, shard, store, envelope, publisher) -> None:
        import pathlib

        if envelope.message["line"] == "hang" and (pathlib.Path(__file__).parent / "hang").exists():
            await asyncio.sleep(3600)  # its transaction never commits: SIGKILL comes first
        super().consume_message(shard, store, envelope, publisher)
"""


async def test_dead_letter_exactly_once_across_sigkill(broker_proc: BrokerProcess,
                                                       tmp_path: Path) -> None:
    """`printf 'not json\\n' | streamkit journals append` into a dead-lettering source of a
    `streamkit run`, which is SIGKILLed before that transaction commits: run again, every
    line is counted once and exactly one dead letter of the frame is committed."""
    source = {"topic": "wordcount/lines", "content_type": "application/x-ndjson", "key": "id",
              "on_undecodable": DEAD_LETTER}
    app = copy_wordcount(tmp_path / "wordcount", shards=2, sources=[source])
    _app_variant(app, "Hanging", HANGING)
    (app / "hang").touch()
    address = broker_proc.address
    run = run_app(app, address, tmp_path / "run-1.log")
    try:
        async with AppView(app, address) as view:
            assert view.client is not None
            await view.wait_serving(timeout=60)
            first = Feeder(app, address, tmp_path / "feed-1.log", count=200,
                           interval=0).start().finish()
            journal = view.config.topic_journals("wordcount/lines")[0]
            bad_at = (await view.heads())[journal]
            # One append, so that one transaction consumes both: the garbage, then a line
            # (without a UUID: committed as it is) on which consume_message hangs.
            done = cli("journals", "append", journal, "--broker", address,
                       input_text='not json\n{"id": 10000, "line": "hang"}\n')
            assert done.returncode == 0, done.stderr
            letters = view.config.dead_letter_journal
            await eventually(lambda: f"dead-lettered to {letters} the message of {journal} at "
                             f"offset {bad_at}" in run.text(), 30, "the dead-letter warning")

            async def written() -> list[Any]:
                assert view.client is not None
                found = await read_journals(view.client, [letters], ReadUncommitted)
                return [m for m in found if "journal" in m]

            await eventually(written, 30, "the uncommitted dead letter")
            run.kill()
            (app / "hang").unlink()
            run = run_app(app, address, tmp_path / "run-2.log")
            second = Feeder(app, address, tmp_path / "feed-2.log", start=200, count=200,
                            interval=0).start().finish()

            serving = await view.wait_caught_up(timeout=60)
            expected = expected_counts([*first, *second])
            assert await view.query_counts(serving) == expected
            totals = totals_of_updates(await view.output_updates())
            assert totals.pop("hang") == 1 and totals == expected
            (letter,) = await read_journals(view.client, [letters])
            assert (letter["journal"], letter["offset"]) == (journal, bad_at)
            assert base64.b64decode(letter["raw"]) == b"not json\n"
            assert len(await written()) == 2  # the killed transaction's copy, never committed
    finally:
        run.stop()
