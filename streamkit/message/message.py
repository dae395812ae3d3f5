"""What a message is: a pydantic `Message`, a plain dict, or a protobuf message.

Every message that takes part in exactly-once processing carries the UUID the
publisher gives it, in a field named `uuid`:

* `Message` subclasses (pydantic models) have a `uuid: UUID | None` field;
* dict messages keep it under the key "uuid" (as its string form);
* protobuf messages need a string field named `uuid`.

A Message type opts out of UUIDs, and so out of exactly-once, with the class
attribute `uses_uuid = False`: it is published without a UUID, and readers pass
it through as committed, without de-duplication.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar
from uuid import UUID

from google.protobuf.message import Message as ProtoMessage
from pydantic import BaseModel, ConfigDict

UUID_FIELD = "uuid"


class Message(BaseModel):
    """Base class of user message models.

    Override `validate_message` for checks that must pass before publishing
    (it runs before mapping and before anything is appended), and
    `new_acknowledgement` if an acknowledgement of your type needs more than
    its UUID.
    """

    model_config = ConfigDict(extra="ignore")
    uses_uuid: ClassVar[bool] = True

    uuid: UUID | None = None

    def validate_message(self) -> None:
        """Raise ValueError if this message must not be published."""

    @classmethod
    def new_acknowledgement(cls, journal: str) -> Message:
        """An empty message of this type to carry an ACK_TXN UUID into `journal`."""
        return cls.model_construct()


MessageLike = Message | dict[str, Any] | ProtoMessage


def uses_uuid(message: MessageLike) -> bool:
    """Whether the message takes part in exactly-once processing."""
    if isinstance(message, Message):
        return type(message).uses_uuid
    return isinstance(message, dict) or UUID_FIELD in message.DESCRIPTOR.fields_by_name


def get_uuid(message: MessageLike) -> UUID | None:
    """The message's UUID, or None if it has none (or opted out)."""
    if isinstance(message, Message):
        return message.uuid if type(message).uses_uuid else None
    raw = message.get(UUID_FIELD) if isinstance(message, dict) else _proto_uuid(message)
    if not raw:
        return None
    return raw if isinstance(raw, UUID) else UUID(raw)


def set_uuid(message: MessageLike, uuid: UUID) -> None:
    """Record the publisher-assigned UUID in the message (a no-op if it opted out)."""
    if isinstance(message, Message):
        if type(message).uses_uuid:
            message.uuid = uuid
    elif isinstance(message, dict):
        message[UUID_FIELD] = str(uuid)
    elif UUID_FIELD in message.DESCRIPTOR.fields_by_name:
        setattr(message, UUID_FIELD, str(uuid))


def validate(message: MessageLike) -> None:
    """Run a Message's own pre-publish validation; dicts and protobufs have none."""
    if isinstance(message, Message):
        message.validate_message()


def new_acknowledgement(message: MessageLike, journal: str) -> MessageLike:
    """An acknowledgement of the same kind as `message`, to be given an ACK_TXN UUID."""
    if isinstance(message, Message):
        return type(message).new_acknowledgement(journal)
    if isinstance(message, dict):
        return {}
    return type(message)()


def _proto_uuid(message: ProtoMessage) -> str:
    if UUID_FIELD not in message.DESCRIPTOR.fields_by_name:
        return ""
    return getattr(message, UUID_FIELD)


@dataclass(slots=True)
class Envelope:
    """A message read from a journal, with where it was: bytes [begin, end)."""

    journal: str
    begin: int
    end: int
    message: MessageLike
