"""`journals apply`: compare a spec file with the broker's journals, then apply the difference.

The file is the desired state; each node's `revision` says which version of
the journal the user edited (0: "I am creating it", -1: "don't check"). The
plan is computed client-side so that a dry run can show it and so that a
stale revision is reported by journal name before anything is written.
The broker still checks every revision again in one transaction: whatever
changed between our listing and the Apply fails it as a whole. With
--max-txn-size the changes go in several transactions, and those before a
failing one stay applied: the error names the changes applied and those not,
and applying the same file again does the rest (what was applied now matches
the file, so it is unchanged).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import click

from streamkit.cli.errors import DATA_ERROR, FAILURE, CliError, explain
from streamkit.cli.inputs import read_text_input
from streamkit.client import BrokerClient, EtcdTransactionFailed, list_journals, listing
from streamkit.protocol import pb
from streamkit.protocol.spec import JournalSpec
from streamkit.protocol.spec_tree import SpecEntry, load_specs

__all__ = ["Action", "apply_specs", "plan_changes"]

NO_CHECK = -1
_VERBS = {  # verb -> (dry-run form, done form)
    "create": ("would create", "created"),
    "update": ("would update", "updated"),
    "delete": ("would delete", "deleted"),
    "unchanged": ("unchanged", "unchanged"),
}
_RELIST_HINT = "re-run list -o yaml and edit again"


@dataclass(frozen=True)
class Action:
    """What applying one spec-file entry does to its journal."""

    verb: str
    name: str
    current_revision: int  # 0 when the journal doesn't exist
    change: pb.ApplyRequest.Change | None = None
    diff: list[str] = field(default_factory=list)


def _flat(value: Any, path: str = "") -> dict[str, str]:
    """A spec's fields as {"fragment.length": "1024", "labels": "a=1,b=2"} for diffs."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for key, inner in value.items():
            out.update(_flat(inner, f"{path}.{key}" if path else key))
        return out
    if path == "labels":
        return {path: ",".join(f"{lbl['name']}={lbl['value']}" for lbl in value) or "(none)"}
    if isinstance(value, list):
        return {path: ",".join(map(str, value)) or "(none)"}
    return {path: str(value)}


def spec_diff(old: JournalSpec, new: JournalSpec) -> list[str]:
    """One "field: old -> new" line per differing field."""
    before, after = _flat(old.model_dump(mode="json")), _flat(new.model_dump(mode="json"))
    return [
        f"{key}: {before.get(key, '(none)')} -> {after.get(key, '(none)')}"
        for key in sorted(before.keys() | after.keys())
        if before.get(key) != after.get(key)
    ]


def _stale_message(name: str, expected: int, current: int) -> str:
    if expected == 0:
        return (
            f"journal {name} already exists at revision {current} but the file creates it "
            f"(revision 0) (ETCD_TRANSACTION_FAILED); {_RELIST_HINT}, or use --upsert"
        )
    return f"journal {name} changed since revision {expected} (ETCD_TRANSACTION_FAILED); " + (
        _RELIST_HINT
    )


def _upsert_action(
    entry: SpecEntry, current: pb.ListResponse.Journal | None, expected: int
) -> Action:
    spec = entry.spec
    if current is None:
        change = pb.ApplyRequest.Change(expect_mod_revision=expected, upsert=spec.to_proto())
        return Action("create", spec.name, 0, change)
    old = JournalSpec.from_proto(current.spec)
    if old == spec:
        return Action("unchanged", spec.name, current.mod_revision)
    change = pb.ApplyRequest.Change(expect_mod_revision=expected, upsert=spec.to_proto())
    return Action("update", spec.name, current.mod_revision, change, spec_diff(old, spec))


def _delete_action(
    entry: SpecEntry, current: pb.ListResponse.Journal | None, expected: int
) -> Action:
    name = entry.spec.name
    if current is None:
        return Action("unchanged", name, 0, diff=["already absent"])
    if expected == 0:
        raise CliError(
            f"journal {name}: deleting needs the revision from `journals list -o yaml` "
            "(or -1, or --upsert, to skip the check)",
            DATA_ERROR,
        )
    change = pb.ApplyRequest.Change(expect_mod_revision=expected, delete=name)
    return Action("delete", name, current.mod_revision, change)


def plan_changes(
    entries: Iterable[SpecEntry],
    current: Mapping[str, pb.ListResponse.Journal],
    *,
    upsert: bool = False,
) -> list[Action]:
    """The action for each entry; raises CliError listing every stale revision."""
    actions, stale = [], []
    for entry in entries:
        expected = NO_CHECK if upsert else entry.revision
        journal = current.get(entry.spec.name)
        make = _delete_action if entry.delete else _upsert_action
        action = make(entry, journal, expected)
        if action.change is not None and expected not in (NO_CHECK, action.current_revision):
            stale.append(_stale_message(action.name, expected, action.current_revision))
        actions.append(action)
    if stale:
        raise CliError("\n".join(stale), FAILURE)
    return actions


def _echo_actions(
    actions: list[Action], after: Mapping[str, pb.ListResponse.Journal] | None
) -> None:
    """One line per action; `after` is the listing after applying (None for a dry run)."""
    for action in actions:
        verb = _VERBS[action.verb][0 if after is None else 1]
        revision = action.current_revision
        if after is not None and action.verb in ("create", "update") and action.name in after:
            revision = after[action.name].mod_revision
        was = "was " if after is not None and action.verb == "delete" else ""
        at = f" ({was}revision {revision})" if revision else ""
        click.echo(f"{verb} {action.name}{at}")
        for line in action.diff:
            click.echo(f"    {line}")


def _summary(actions: list[Action], *, dry_run: bool) -> str:
    counts = ", ".join(
        f"{sum(a.verb == verb for a in actions)} {done}" for verb, (_, done) in _VERBS.items()
    )
    return f"dry run, nothing applied: {counts}" if dry_run else counts


async def _current(client: BrokerClient) -> dict[str, pb.ListResponse.Journal]:
    return {journal.spec.name: journal for journal in await list_journals(client)}


async def _explain_conflict(
    client: BrokerClient, entries: list[SpecEntry], upsert: bool
) -> str:
    """The broker refused a revision: list again to name the journals that moved."""
    try:
        plan_changes(entries, await _current(client), upsert=upsert)
    except CliError as stale:
        return "; ".join(str(stale).splitlines())
    return ("journals changed while applying (ETCD_TRANSACTION_FAILED), into what the file "
            "says: applying it again checks afresh")


def _named(actions: list[Action]) -> str:
    return ", ".join(f"{action.verb} {action.name}" for action in actions)


async def _apply_batches(
    client: BrokerClient, entries: list[SpecEntry], actions: list[Action], *, upsert: bool,
    max_txn_size: int,
) -> None:
    """Apply the changes in transactions of at most `max_txn_size` (0: one), in order.

    Batches before a failing one stay applied, so the error names what was applied and
    what was not: the changes applied show as unchanged when the same file is applied
    again, which then does the rest.
    """
    pending = [action for action in actions if action.change is not None]
    size = max_txn_size if max_txn_size > 0 else len(pending)
    for start in range(0, len(pending), size):
        batch = pending[start : start + size]
        try:
            await listing.apply_journals(client, [action.change for action in batch])
        except Exception as err:
            if isinstance(err, EtcdTransactionFailed):
                left = {action.name for action in pending[start:]}
                what, code = await _explain_conflict(
                    client, [e for e in entries if e.spec.name in left], upsert), FAILURE
            else:
                lines, code = explain(err)  # (raises `err` itself if it is no failure explained)
                what = "; ".join(lines)
            # (The broker's changes[i] counts from the start of the batch named; a stale
            # revision is named already.)
            stale = isinstance(err, EtcdTransactionFailed)
            failed = what if stale else f"applying {_named(batch)} failed: {what}"
            if start == 0:
                raise CliError(f"{failed}\nnothing was applied", code) from None
            raise CliError(
                f"{failed}\napplied {start} of {len(pending)} changes: {_named(pending[:start])}"
                f"\nnot applied: {_named(pending[start:])}\napplying the same file again "
                "applies the rest (the changes applied show as unchanged)", code,
            ) from None


def read_spec_file(path: str) -> list[SpecEntry]:
    """Load and validate a spec file ("-" for stdin); SpecError lists every problem."""
    text, source = read_text_input(path, "spec file")
    return load_specs(text, source)


async def apply_specs(
    client: BrokerClient,
    entries: list[SpecEntry],
    *,
    dry_run: bool,
    upsert: bool,
    max_txn_size: int,
) -> None:
    """Plan, print and (unless `dry_run`) apply the changes of `entries`."""
    current = await _current(client)
    actions = plan_changes(entries, current, upsert=upsert)
    changes = [action.change for action in actions if action.change is not None]
    if changes and not dry_run:
        await _apply_batches(client, entries, actions, upsert=upsert, max_txn_size=max_txn_size)
        current = await _current(client)  # for the new revisions
    _echo_actions(actions, None if dry_run else current)
    click.echo(_summary(actions, dry_run=dry_run) if actions else "no journals in the file")
