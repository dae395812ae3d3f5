"""`streamkit shards …`: list, apply, stat, unassign shards and show their hints (as gazctl does).

Commands find the application's KeySpace from its folder (--app, default the
current one: the root comes from streamkit.yaml and the KeySpace is the one
`streamkit run` keeps in the app's data folder), or from --keyspace and
--root. list, apply, unassign and hints work on the KeySpace directly, with
the same functions the members' Shard API serves; stat asks the shard's
primary member over gRPC, as it alone knows how far the shard got. With
--consumer (gazctl's $CONSUMER_ADDRESS) they all call one member's Shard API
instead (see `streamkit.cli.shard_access`).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import click
import grpc
from google.protobuf import json_format

from streamkit.app.config import CONFIG_FILE, load_config
from streamkit.app.shard_ops import BadRequest, CorruptHints
from streamkit.auth.settings import Security
from streamkit.cli.app_keyspace import app_keyspace
from streamkit.cli.errors import DATA_ERROR, FAILURE, CliError, async_command, warn
from streamkit.cli.inputs import read_text_input
from streamkit.cli.output import echo_json, echo_table, format_labels, plural
from streamkit.cli.params import Seconds
from streamkit.cli.security_options import security_options
from streamkit.cli.shard_access import (
    CONSUMER_ENV,
    KeySpaceShards,
    MemberShards,
    ShardAccess,
    Unreachable,
)
from streamkit.keyspace import open_keyspace
from streamkit.keyspace.keyspace import KeySpace, KeySpaceError, sqlite_path
from streamkit.protocol import consumer_pb
from streamkit.protocol.labels import parse_selector
from streamkit.protocol.problems import SpecError
from streamkit.protocol.shard_spec import (
    ShardEntry,
    ShardSpecModel,
    dump_shard_specs,
    load_shard_entries,
)
from streamkit.protocol.spec import MAX_OFFSET
from streamkit.recoverylog.fsm import hints_to_json

__all__ = ["shards"]

F = TypeVar("F", bound=Callable[..., Any])
Listed = consumer_pb.ListResponse.Shard
Code = consumer_pb.ReplicaStatus.Code
NO_CHECK = -1
_RELIST_HINT = "re-run `streamkit shards list -o yaml` and edit again"


# --- reaching the app's KeySpace --------------------------------------------------------


def app_options(fn: F) -> F:
    """--app, --keyspace and --root: where the application's shards are kept."""
    fn = click.option("--root", metavar="ROOT", default=None,
                      help="KeySpace root of the app, /gazette/consumers/NAME "
                           "(default: from the app's streamkit.yaml).")(fn)
    fn = click.option("--keyspace", "keyspace_url", metavar="URL", default=None,
                      envvar="STREAMKIT_KEYSPACE", show_envvar=True,
                      help="KeySpace file, sqlite:/// or etcd://host:port/prefix URL "
                           "(default: the app's, in its data folder).")(fn)
    return click.option("--app", "app_dir", metavar="DIR", default=".", show_default=True,
                        type=click.Path(file_okay=False, path_type=Path),
                        help="The app's folder (holding streamkit.yaml).")(fn)


def _sqlite_file(url: str) -> Path | None:
    """The file an embedded KeySpace URL names, None for etcd; a malformed URL (a mistyped
    etcd one, say) is bad input."""
    try:
        path = sqlite_path(url)
    except KeySpaceError as err:
        raise CliError(str(err), DATA_ERROR) from None
    return None if path is None else Path(path)


def _locate(app_dir: Path, keyspace_url: str | None, root: str | None) -> tuple[str, str]:
    """The KeySpace URL and root to use, from the options or the app's streamkit.yaml."""
    if keyspace_url is None or root is None:
        if keyspace_url is not None and not (app_dir / CONFIG_FILE).exists():
            raise CliError(f"--keyspace needs --root /gazette/consumers/NAME (no {CONFIG_FILE} "
                           f"in {app_dir} to take it from)", DATA_ERROR)
        config = load_config(app_dir)
        root = root or config.keyspace_root
        keyspace_url = app_keyspace(config, app_dir, keyspace_url)
    if not root.startswith("/") or root.rstrip("/") == "":
        raise CliError(f"--root must be an absolute KeySpace path such as "
                       f"/gazette/consumers/NAME (got {root!r})", DATA_ERROR)
    path = _sqlite_file(keyspace_url)
    if path is not None and not path.exists():
        raise CliError(f"no KeySpace at {path}")
    return keyspace_url, root.rstrip("/")


@contextlib.asynccontextmanager
async def opened(app_dir: Path, keyspace_url: str | None,
                 root: str | None) -> AsyncIterator[tuple[KeySpace, str]]:
    """The app's KeySpace and root; the shared functions' errors become CLI errors."""
    url, root = _locate(app_dir, keyspace_url, root)
    try:
        keyspace = open_keyspace(url)
    except KeySpaceError as err:
        raise CliError(str(err), DATA_ERROR) from None
    try:
        yield keyspace, root
    except BadRequest as err:
        raise CliError(str(err), DATA_ERROR) from None
    except CorruptHints as err:
        raise CliError(str(err)) from None
    except KeySpaceError as err:
        raise CliError(f"KeySpace {url}: {err}") from None
    finally:
        await keyspace.close()


def reach_options(fn: F) -> F:
    """The app options, --consumer, and the security options to dial members with."""
    fn = security_options(dials=True)(fn)
    fn = click.option("--consumer", metavar="URL", default=None, envvar=CONSUMER_ENV,
                      show_envvar=True,
                      help="Call this member's Shard API (host:port, http:// or https://) "
                           "instead of using the KeySpace, as gazctl does.")(fn)
    return app_options(fn)


_RPC_EXIT = {grpc.StatusCode.INVALID_ARGUMENT: DATA_ERROR}


@contextlib.asynccontextmanager
async def reached(app_dir: Path, keyspace_url: str | None, root: str | None,
                  consumer: str | None, security: Security) -> AsyncIterator[ShardAccess]:
    """The app's shards, through the KeySpace or through the member at `consumer`; what the
    member answers with an RPC error becomes a CLI error naming it."""
    if not consumer:
        async with opened(app_dir, keyspace_url, root) as (keyspace, app_root):
            access = KeySpaceShards(keyspace, app_root, security)
            try:
                yield access
            finally:
                await access.close()
        return
    member = MemberShards(consumer, security)
    try:
        yield member
    except grpc.aio.AioRpcError as err:
        details = " ".join((err.details() or "").split())
        raise CliError(f"member {member.address}: {err.code().name}: {details}",
                       _RPC_EXIT.get(err.code(), FAILURE)) from None
    finally:
        await member.close()


def _member_name(route_member: Any) -> str:
    return f"{route_member.zone}#{route_member.suffix}"


# --- the group --------------------------------------------------------------------------


@click.group()
def shards() -> None:
    """List, apply, inspect and unassign an application's shards."""


# --- list -------------------------------------------------------------------------------


def _has_primary(route: Any) -> bool:
    return 0 <= route.primary < len(route.members)


def _status_of(shard: Listed) -> str:
    if not shard.route.members:
        return "DISABLED" if shard.spec.disable else "UNASSIGNED"
    if not _has_primary(shard.route):
        return "NO PRIMARY"
    primary = shard.route.primary
    return Code.Name(shard.status[primary].code) if primary < len(shard.status) else "IDLE"


def _primary_of(shard: Listed) -> str:
    route = shard.route
    if not _has_primary(route):
        return "-"
    name = _member_name(route.members[route.primary])
    endpoint = route.endpoints[route.primary] if route.primary < len(route.endpoints) else ""
    return f"{name} ({endpoint})" if endpoint else name


def _spec_json(spec: consumer_pb.ShardSpec) -> dict[str, Any]:
    try:
        return ShardSpecModel.from_proto(spec).model_dump(mode="json")
    except SpecError:  # stored by another tool without our checks: show it as it is
        return json_format.MessageToDict(spec, preserving_proto_field_name=True)


def _shard_json(shard: Listed) -> dict[str, Any]:
    route = shard.route
    return {
        "id": shard.spec.id,
        "mod_revision": shard.mod_revision,
        "create_revision": shard.create_revision,
        "status": _status_of(shard),
        "route": [
            {"member": _member_name(member),
             "endpoint": route.endpoints[i] if i < len(route.endpoints) else "",
             "primary": i == route.primary,
             "status": Code.Name(shard.status[i].code) if i < len(shard.status) else "IDLE",
             "errors": list(shard.status[i].errors) if i < len(shard.status) else []}
            for i, member in enumerate(route.members)
        ],
        "spec": _spec_json(shard.spec),
    }


def _shard_row(shard: Listed) -> list[object]:
    standbys = len(shard.route.members) - _has_primary(shard.route)
    return [shard.spec.id, _status_of(shard), _primary_of(shard), standbys,
            shard.mod_revision, format_labels(shard.spec.labels) or "-"]


@shards.command("list")
@click.option("-l", "--selector", metavar="SELECTOR", default="",
              help='Label selector, e.g. "app=wordcount" or "id=shard-000"; all if omitted.')
@click.option("-o", "--output", "--format", "output", type=click.Choice(["table", "json", "yaml"]),
              default="table", show_default=True,
              help="yaml is the spec-file form (with revisions) that `apply` takes back.")
@reach_options
@async_command()
async def list_cmd(selector: str, output: str, app_dir: Path, keyspace_url: str | None,
                   root: str | None, consumer: str | None, security: Security) -> None:
    """List shards: their status, primary member, standbys and labels."""
    parsed = parse_selector(selector)
    async with reached(app_dir, keyspace_url, root, consumer, security) as access:
        listed = list((await access.list(parsed)).shards)
        if not listed and not selector and isinstance(access, KeySpaceShards):
            # An empty list in a KeySpace shared by several apps: likely a typo in its URL.
            warn(f"no shards under {access.root} in this KeySpace: is the app deployed "
                 "there (is --keyspace's prefix right)?")
    if output == "yaml":
        entries = [ShardEntry(ShardSpecModel.from_proto(s.spec), s.mod_revision) for s in listed]
        click.echo(dump_shard_specs(entries), nl=False)
        return
    if output == "json":
        echo_json([_shard_json(s) for s in listed])
        return
    echo_table(["ID", "STATUS", "PRIMARY", "STANDBYS", "REVISION", "LABELS"],
               [_shard_row(s) for s in listed])
    for shard in listed:
        for member, status in zip(shard.route.members, shard.status, strict=False):
            for error in status.errors:
                warn(f"{shard.spec.id} at {_member_name(member)}: {Code.Name(status.code)}: "
                     f"{error}")


# --- apply ------------------------------------------------------------------------------

_VERBS = {  # verb -> (dry-run form, done form)
    "create": ("would create", "created"),
    "update": ("would update", "updated"),
    "delete": ("would delete", "deleted"),
    "unchanged": ("unchanged", "unchanged"),
}


@dataclass(frozen=True)
class Action:
    """What applying one file entry does to its shard."""

    verb: str
    shard: str
    current_revision: int  # 0 when the shard doesn't exist
    change: consumer_pb.ApplyRequest.Change | None = None
    diff: list[str] = field(default_factory=list)


def _diff(old: ShardSpecModel, new: ShardSpecModel) -> list[str]:
    """One "field: old -> new" line per setting that differs."""
    before, after = old.model_dump(mode="json"), new.model_dump(mode="json")
    return [f"{key}: {json.dumps(before[key])} -> {json.dumps(after[key])}"
            for key in before if before[key] != after[key]]


def _action(entry: ShardEntry, current: Listed | None) -> Action:
    shard = entry.spec.id
    revision = current.mod_revision if current is not None else 0
    if entry.delete:
        if current is None:
            return Action("unchanged", shard, 0, diff=["already absent"])
        if entry.revision == 0:
            raise CliError(f"shard {shard}: deleting needs the revision from `streamkit shards "
                           "list -o yaml` (or -1 to skip the check)", DATA_ERROR)
        change = consumer_pb.ApplyRequest.Change(expect_mod_revision=entry.revision,
                                                 delete=shard)
        return Action("delete", shard, revision, change)
    change = consumer_pb.ApplyRequest.Change(expect_mod_revision=entry.revision,
                                             upsert=entry.spec.to_proto())
    if current is None:
        return Action("create", shard, 0, change)
    try:
        old = ShardSpecModel.from_proto(current.spec)
    except SpecError:
        return Action("update", shard, revision, change, ["(stored spec is invalid)"])
    if old == entry.spec:
        return Action("unchanged", shard, revision)
    return Action("update", shard, revision, change, _diff(old, entry.spec))


def _stale(action: Action, expected: int) -> str:
    if expected == 0:
        return (f"shard {action.shard} already exists at revision {action.current_revision} "
                f"but the file creates it (revision 0) (ETCD_TRANSACTION_FAILED); "
                f"{_RELIST_HINT}, or give revision: -1")
    return (f"shard {action.shard} changed since revision {expected} (now "
            f"{action.current_revision or 'deleted'}) (ETCD_TRANSACTION_FAILED); {_RELIST_HINT}")


def plan(entries: list[ShardEntry], current: Mapping[str, Listed]) -> list[Action]:
    """The action of each entry; raises CliError naming every shard with a stale revision."""
    actions, stale = [], []
    for entry in entries:
        action = _action(entry, current.get(entry.spec.id))
        if action.change is not None and entry.revision not in (NO_CHECK,
                                                                action.current_revision):
            stale.append(_stale(action, entry.revision))
        actions.append(action)
    if stale:
        raise CliError("\n".join(stale))
    return actions


def _read_file(path: str) -> list[ShardEntry]:
    text, source = read_text_input(path, "shard file")
    return load_shard_entries(text, source)


async def _current(access: ShardAccess) -> dict[str, Listed]:
    return {s.spec.id: s for s in (await access.list()).shards}


@shards.command("apply")
@click.argument("specs_path", metavar="SPECS.yaml")
@click.option("--dry-run", is_flag=True, help="Show what would change; change nothing.")
@reach_options
@async_command()
async def apply_cmd(specs_path: str, dry_run: bool, app_dir: Path, keyspace_url: str | None,
                    root: str | None, consumer: str | None, security: Security) -> None:
    """Create, update or delete shards to match SPECS.yaml ("-" for stdin).

    A shard's `revision` is the mod revision the file was edited from (as
    `list -o yaml` writes it): 0 creates the shard, -1 skips the check.
    `delete: true` deletes it. All changes are one transaction: if any shard
    changed since, nothing is written.

    Note that `streamkit run` rewrites the shards streamkit.yaml describes.
    """
    entries = _read_file(specs_path)
    if not entries:
        click.echo("no shards in the file")
        return
    async with reached(app_dir, keyspace_url, root, consumer, security) as access:
        actions = plan(entries, await _current(access))
        changes = [a.change for a in actions if a.change is not None]
        after = None
        if changes and not dry_run:
            response = await access.apply(changes)
            if response.status == consumer_pb.ETCD_TRANSACTION_FAILED:
                plan(entries, await _current(access))  # names the shards that moved
                raise CliError(f"shards changed while applying (ETCD_TRANSACTION_FAILED); "
                               f"{_RELIST_HINT}")
            after = await _current(access)
    for action in actions:
        verb = _VERBS[action.verb][0 if dry_run else 1]
        revision = action.current_revision
        if after is not None and action.verb in ("create", "update") and action.shard in after:
            revision = after[action.shard].mod_revision
        was = "was " if not dry_run and action.verb == "delete" else ""
        click.echo(f"{verb} {action.shard}" + (f" ({was}revision {revision})" if revision else ""))
        for line in action.diff:
            click.echo(f"    {line}")
    counts = ", ".join(f"{sum(a.verb == verb for a in actions)} {done}"
                       for verb, (_, done) in _VERBS.items())
    click.echo(f"dry run, nothing applied: {counts}" if dry_run else counts)


# --- stat -------------------------------------------------------------------------------


class OffsetType(click.ParamType):
    """JOURNAL=OFFSET, an offset the shard must have read through."""

    name = "journal=offset"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> tuple[str, int]:
        if isinstance(value, tuple):
            return value
        journal, sep, offset = str(value).rpartition("=")
        if not sep or not journal or not offset.isdigit() or int(offset) > MAX_OFFSET:
            self.fail(f"expected JOURNAL=OFFSET with a non-negative 64-bit offset (got "
                      f"{value!r})",
                      param, ctx)
        return journal, int(offset)


def _stat_error(shard: str, status: int) -> CliError:
    name = consumer_pb.Status.Name(status)
    reasons = {
        consumer_pb.SHARD_NOT_FOUND: f"shard {shard} not found",
        consumer_pb.NO_SHARD_PRIMARY: f"shard {shard} has no primary right now "
                                      "(is the app running?)",
        consumer_pb.SHARD_STOPPED: f"shard {shard} stopped before answering",
        consumer_pb.NOT_SHARD_PRIMARY: f"the member asked is no longer shard {shard}'s primary",
    }
    return CliError(f"{reasons.get(status, f'shard {shard}: Stat failed')} ({name})")


async def _stat(access: ShardAccess, shard: str, read_through: dict[str, int],
                timeout: float) -> tuple[consumer_pb.StatResponse, str, str]:
    """Stat from the shard's primary member: (response, member, endpoint)."""
    request = consumer_pb.StatRequest(shard=shard, read_through=read_through)
    try:
        response, member, endpoint = await access.stat(request, timeout)
    except Unreachable as unreachable:
        err = unreachable.__cause__
        if not isinstance(err, grpc.aio.AioRpcError):
            raise _stat_error(shard, unreachable.status) from None
        details = " ".join((err.details() or "").split())
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            if read_through:
                raise CliError(f"shard {shard} did not read through the given offsets within "
                               f"{timeout:g}s") from None
            raise CliError(f"shard {shard}'s primary {unreachable.where} did not answer "
                           f"within {timeout:g}s (stopped, busy recovering, or a hook of the "
                           f"app stuck? see the member's log)") from None
        if err.code() == grpc.StatusCode.UNAVAILABLE:
            raise CliError(f"cannot reach shard {shard}'s primary {unreachable.where}: "
                           f"{details}") from None
        raise CliError(f"Stat of {shard} failed ({err.code().name}): {details}",
                       _RPC_EXIT.get(err.code(), FAILURE)) from None
    if response.status != consumer_pb.OK:
        raise _stat_error(shard, response.status)
    return response, member, endpoint


def _ago(when: float | None) -> str:
    return "never" if not when else f"{max(0.0, time.time() - when):.1f}s ago"


@shards.command("stat")
@click.argument("shard")
@click.option("--read-through", "read_through", type=OffsetType(), multiple=True,
              metavar="JOURNAL=OFFSET",
              help="Wait until the shard has processed this source journal through OFFSET "
                   "(repeatable).")
@click.option("--timeout", type=Seconds(min=0, min_open=True), default=30.0,
              show_default=True, help="Seconds to wait for the primary's answer.")
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table",
              show_default=True)
@reach_options
@async_command()
async def stat_cmd(shard: str, read_through: tuple[tuple[str, int], ...], timeout: float,
                   output: str, app_dir: Path, keyspace_url: str | None,
                   root: str | None, consumer: str | None, security: Security) -> None:
    """How far SHARD got: offsets read through per source and written through per output.

    With --read-through, answers only once the shard committed a transaction
    past those offsets (read-your-writes after publishing).
    """
    async with reached(app_dir, keyspace_url, root, consumer, security) as access:
        try:
            response, member, endpoint = await _stat(access, shard, dict(read_through), timeout)
        except CliError as error:
            listed = None
            if "NO_SHARD_PRIMARY" in str(error):
                with contextlib.suppress(Exception):  # (a token that may not list, say)
                    listed = (await _current(access)).get(shard)
            if listed is not None and listed.spec.disable:
                raise CliError(f"shard {shard} is disabled (its spec's `disable`): no primary "
                               "serves it (NO_SHARD_PRIMARY)") from None
            raise
    try:
        extension = json.loads(response.extension) if response.extension else {}
    except ValueError:
        extension = {}
    if output == "json":
        echo_json({"shard": shard, "member": member, "endpoint": endpoint,
                   "read_through": dict(sorted(response.read_through.items())),
                   "publish_at": dict(sorted(response.publish_at.items())), **extension})
        return
    rows = [["read", j, o] for j, o in sorted(response.read_through.items())]
    rows += [["published", j, o] for j, o in sorted(response.publish_at.items())]
    echo_table(["", "JOURNAL", "OFFSET"], rows)
    summary = f"{shard}: {extension.get('status', 'PRIMARY')} at {member} ({endpoint})"
    if extension:
        summary += (f"; {plural(extension.get('transactions', 0), 'transaction')}, "
                    f"{plural(extension.get('messages', 0), 'message')}, last commit "
                    f"{_ago(extension.get('last_commit'))}")
    click.echo(summary, err=True)


# --- unassign ---------------------------------------------------------------------------


@shards.command("unassign")
@click.argument("shard_ids", metavar="[SHARD...]", nargs=-1)
@click.option("--only-failed", is_flag=True,
              help="Only remove FAILED assignments; leave healthy primaries in place. "
                   "Without SHARDs: every shard's.")
@click.option("--dry-run", is_flag=True, help="Show what would be unassigned; change nothing.")
@reach_options
@async_command()
async def unassign_cmd(shard_ids: tuple[str, ...], only_failed: bool, dry_run: bool,
                       app_dir: Path, keyspace_url: str | None, root: str | None,
                       consumer: str | None, security: Security) -> None:
    """Remove shards' assignments so they are assigned afresh (restarting a FAILED shard).

    FAILED assignments are always removed, the primary too unless --only-failed.
    """
    if not shard_ids and not only_failed:
        raise click.UsageError("name the shards to unassign, or give --only-failed to restart "
                               "every FAILED one")
    async with reached(app_dir, keyspace_url, root, consumer, security) as access:
        if not shard_ids:
            shard_ids = tuple(sorted(await _current(access)))
            if not shard_ids:
                click.echo("nothing to unassign (no shards)", err=True)
                return
        response = await access.unassign(shard_ids, only_failed=only_failed, dry_run=dry_run)
        if response.status == consumer_pb.SHARD_NOT_FOUND:
            known = await _current(access)
            missing = [s for s in shard_ids if s not in known] or list(shard_ids)
            raise CliError(f"shard not found (SHARD_NOT_FOUND): {', '.join(missing)}")
    if response.status == consumer_pb.ETCD_TRANSACTION_FAILED:
        raise CliError("assignments changed while unassigning (ETCD_TRANSACTION_FAILED); "
                       "try again")
    for shard in response.shards:
        click.echo(shard)
    verb = "would unassign" if dry_run else "unassigned"
    if response.shards:
        click.echo(f"{verb} {plural(len(response.shards), 'shard')}", err=True)
    else:
        click.echo("nothing to unassign" + (" (no FAILED assignment)" if only_failed else ""),
                   err=True)


# --- hints ------------------------------------------------------------------------------


def _hints_json(found: consumer_pb.GetHintsResponse.ResponseHints) -> Any:
    return json.loads(hints_to_json(found.hints)) if found.HasField("hints") else None


@shards.command("hints")
@click.argument("shard")
@reach_options
@async_command()
async def hints_cmd(shard: str, app_dir: Path, keyspace_url: str | None,
                    root: str | None, consumer: str | None, security: Security) -> None:
    """Print SHARD's recovery-log hints as JSON: the primary's, then the backups, newest first."""
    async with reached(app_dir, keyspace_url, root, consumer, security) as access:
        response = await access.hints(shard)
    if response.status == consumer_pb.SHARD_NOT_FOUND:
        raise CliError(f"shard {shard} not found (SHARD_NOT_FOUND)")
    echo_json({"shard": shard, "primary": _hints_json(response.primary_hints),
               "backups": [_hints_json(h) for h in response.backup_hints]})
