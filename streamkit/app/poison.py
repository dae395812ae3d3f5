"""Poison messages: what a shard does with a source frame that doesn't decode (a
BadFrame), or a message its consume_message raised on.

The source's policy in streamkit.yaml (carried by the shard spec's labels)
says: fail (the default), skip, or dead-letter. Live transactions
(`app.txn`) and backfill tasks (`backfill.task`) pass over poison the same
way, so a backfill computes what the live shards would have.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from typing import Any

import orjson

from streamkit.app.config import (
    DEAD_LETTER,
    DEAD_LETTERS_LABEL,
    FAIL,
    ON_CONSUME_ERROR_LABEL,
    ON_UNDECODABLE_LABEL,
    SKIP,
)
from streamkit.app.metrics import count_skipped
from streamkit.app.publishing import ShardPublisher
from streamkit.app.sources import BadFrame
from streamkit.app.watchdog import HookRecord
from streamkit.errors import StreamkitError
from streamkit.message.framings.json_lines import CONTENT_TYPE as NDJSON
from streamkit.message.framings.json_lines import JsonLinesFraming
from streamkit.message.message import Envelope, MessageLike
from streamkit.protocol import consumer_pb

__all__ = ["PoisonGate", "PoisonPolicies", "UnskippableFrame", "consume_each"]

log = logging.getLogger(__name__)


class UnskippableFrame(StreamkitError, ValueError):
    """A bad frame whose source says skip or dead-letter, but whose end is unknown."""


# The streamkit.yaml field each policy label stands for (for messages).
_SETTINGS = {ON_UNDECODABLE_LABEL: "on_undecodable", ON_CONSUME_ERROR_LABEL: "on_consume_error"}
_JSON = JsonLinesFraming()


class PoisonPolicies:
    """What a shard does with its sources' poison messages, from its spec's labels.

    The labels name topics (`<topic>:<policy>`); a journal `<topic>/part-NNN`
    follows its topic's policy, and any other journal fails (the default).
    A bad label is a ValueError, failing the shard before it reads anything.
    """

    def __init__(self, spec: consumer_pb.ShardSpec) -> None:
        self._by_topic: dict[tuple[str, str], str] = {}
        self.dead_letters = ""  # the journal dead letters go to
        for label in spec.labels.labels:
            if label.name == DEAD_LETTERS_LABEL:
                self.dead_letters = label.value
            elif label.name in _SETTINGS:
                topic, _, policy = label.value.rpartition(":")
                if not topic or policy not in (SKIP, DEAD_LETTER):
                    raise ValueError(
                        f"shard {spec.id}: label {label.name}={label.value} is not "
                        f"<topic>:{SKIP} or <topic>:{DEAD_LETTER}"
                    )
                self._by_topic[label.name, topic] = policy
        if DEAD_LETTER in self._by_topic.values() and not self.dead_letters:
            raise ValueError(
                f"shard {spec.id}: a source dead-letters but the spec has no "
                f"{DEAD_LETTERS_LABEL} label naming where to"
            )

    def of(self, journal: str, label: str) -> str:
        """The policy (`label`: ON_UNDECODABLE_LABEL or ON_CONSUME_ERROR_LABEL) of a journal."""
        return self._by_topic.get((label, journal.rpartition("/")[0]), FAIL)

    @property
    def passes_over_consume_errors(self) -> bool:
        """Whether some source skips or dead-letters a message consume_message raised on."""
        return any(label == ON_CONSUME_ERROR_LABEL for label, _ in self._by_topic)


def _as_json(message: MessageLike) -> Any:
    """A decoded message as JSON (as the JSON framing would write it), for a dead letter."""
    out = bytearray()
    try:
        _JSON.encode(message, out)
        return orjson.loads(out)
    except (TypeError, ValueError):  # a dict with values JSON can't hold
        return repr(message)


class PoisonGate:
    """Passes over a shard's poison messages as their sources' policies say."""

    def __init__(self, shard_id: str, policies: PoisonPolicies,
                 publisher: ShardPublisher) -> None:
        self.shard_id, self.policies, self.publisher = shard_id, policies, publisher
        dead_letters = policies.dead_letters
        self._to_dead_letters = lambda _message: (dead_letters, NDJSON)

    def pass_over(self, env: Envelope, error: Exception) -> bool:
        """Skip or dead-letter a poison message, as its source's policy says; False: fail.

        Only a frame whose end is known can be skipped: otherwise good messages
        might go with it, and UnskippableFrame fails the transaction instead.
        """
        bad = env.message if type(env.message) is BadFrame else None
        label = ON_UNDECODABLE_LABEL if bad is not None else ON_CONSUME_ERROR_LABEL
        policy = self.policies.of(env.journal, label)
        if policy == FAIL:
            return False
        setting = f"{_SETTINGS[label]}: {policy}"
        letter: dict[str, Any] = {
            "shard": self.shard_id,
            "journal": env.journal,
            "offset": env.begin,
            "end": env.end,
        }
        if bad is not None:
            if bad.error.frame is None or not bad.error.skippable:
                raise UnskippableFrame(
                    f"{error}; {setting} can't pass it: the framing can't tell where this "
                    "frame ends (it resynchronizes by scanning), so good messages might be "
                    "skipped with it"
                ) from error
            cause, reason = "undecodable", bad.error.reason
            letter |= {
                "cause": cause,
                "error": reason,
                "raw": base64.b64encode(bad.error.frame).decode(),
            }
        else:
            cause, reason = "consume-error", f"{type(error).__name__}: {error}"
            letter |= {"cause": cause, "error": reason, "message": _as_json(env.message)}
        done = "skipped"
        if policy == DEAD_LETTER:
            self.publisher.publish(self._to_dead_letters, letter)
            done = f"dead-lettered to {self.policies.dead_letters}"
        what = "undecodable" if bad is not None else "consume_message raised"
        log.warning(
            "shard %s: %s the message of %s at offset %d (%s): %s: %s",
            self.shard_id,
            done,
            env.journal,
            env.begin,
            setting,
            what,
            reason,
        )
        count_skipped(self.shard_id, env.journal, cause, policy)
        return True


async def consume_each(app: Any, shard: Any, store: Any, publisher: ShardPublisher,
                       envelopes: list[Envelope], is_async: bool,
                       on_poison: Callable[[Envelope, Exception], None],
                       hooks: HookRecord | None = None) -> None:
    """consume_message for each envelope, a bad frame or a message it raised on going to
    `on_poison` (which passes over it, or raises). `hooks` marks the message being consumed,
    for a live shard's watchdog."""
    consume = app.consume_message
    for env in envelopes:
        if hooks is not None:
            hooks.current = env
        try:
            if type(env.message) is BadFrame:
                raise env.message.error
            if is_async:
                await consume(shard, store, env, publisher)
            else:
                consume(shard, store, env, publisher)
        except Exception as error:
            on_poison(env, error)
        finally:
            if hooks is not None:
                hooks.current = None
