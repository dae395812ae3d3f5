"""The rules every Apply request follows, for journals (broker) and shards (consumers) alike.

Gazette's Apply RPCs take a list of changes, each an upsert or a delete of
one named item guarded by `expect_mod_revision` (0: must not exist yet, -1:
don't check). What differs is how an item is validated and named.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["NO_CHECK", "check_apply_changes"]

NO_CHECK = -1  # expect_mod_revision that skips the revision check


def check_apply_changes(
    changes: Iterable[Any],
    item: str,
    upserted: Callable[[Any], str],
    check_deleted: Callable[[str, str], None],
    error: type[ValueError],
) -> None:
    """Raise `error` naming the change (and field) that breaks the rules.

    `upserted(spec)` validates an upsert and returns its name;
    `check_deleted(name, where)` validates a deleted name; `item` is the word
    for what is changed ("journal", "shard").
    """
    seen: set[str] = set()
    for i, change in enumerate(changes):
        upsert = change.HasField("upsert")
        if upsert == bool(change.delete):
            raise error(f"Apply: changes[{i}]: exactly one of upsert or delete is required")
        if upsert:
            name = upserted(change.upsert)
        else:
            name = change.delete
            check_deleted(name, f"Apply: changes[{i}].delete")
            if change.expect_mod_revision == 0:
                raise error(f"Apply: changes[{i}]: deleting {item} {name!r} needs its mod "
                            "revision (or -1 to skip the check), not 0")
        if change.expect_mod_revision < NO_CHECK:
            raise error(f"Apply: changes[{i}]: expect_mod_revision must be >= -1 "
                        f"(got {change.expect_mod_revision})")
        if name in seen:
            raise error(f"Apply: changes[{i}]: {item} {name!r} is changed twice")
        seen.add(name)
    if not seen:
        raise error("Apply: changes: at least one change is required")
