"""`streamkit journals …`: list, apply, append to, read, and prune journals (as gazctl does).

Every command talks to one broker (--broker, else $STREAMKIT_BROKER, else
127.0.0.1:8080), with the TLS and auth-key options of `security_options`. Data
goes to stdout and everything else (progress, summaries of appends, warnings,
errors) to stderr, so that commands compose in pipelines. The commands
themselves are thin: the work lives in the journal_* modules next to this one.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any, TypeVar

import click

from streamkit.app.app_folder import bundled_fragments
from streamkit.auth.settings import Security
from streamkit.cli.errors import DATA_ERROR, CliError, async_command, warn
from streamkit.cli.journal_apply import apply_specs, read_spec_file
from streamkit.cli.journal_fragments import fragment_rows, print_fragments, prune_journals
from streamkit.cli.journal_io import MAPPINGS, append_lines, append_raw, load_offsets
from streamkit.cli.journal_io import read_journals as copy_journals
from streamkit.cli.output import FORMATS, echo_json, echo_table, format_labels, format_size
from streamkit.cli.security_options import security_options
from streamkit.cli.unsettled import opened_output
from streamkit.client import BrokerClient, list_journals
from streamkit.client.environment import BROKER_ENV, DEFAULT_ADDRESS
from streamkit.protocol import pb
from streamkit.protocol.durations import parse_duration
from streamkit.protocol.labels import label_set, parse_selector
from streamkit.protocol.spec import MAX_OFFSET, JournalSpec, journal_name_problem
from streamkit.protocol.spec_tree import SpecEntry, dump_specs

__all__ = ["journals"]

F = TypeVar("F", bound=Callable[..., Any])
Listed = pb.ListResponse.Journal
DEFAULT_FILE_ROOT = bundled_fragments(Path())  # run where the app is


# --- shared options and parameter types ------------------------------------------


def broker_option(fn: F) -> F:
    return click.option(
        "--broker", envvar=list(BROKER_ENV), default=DEFAULT_ADDRESS, show_default=True,
        show_envvar=True, metavar="URL",
        help="Broker address: host:port or http://host:port (plaintext), https://host:port "
             "(TLS).",
    )(fn)


def targets_option(fn: F) -> F:
    """A JOURNAL argument or a -l selector: the journals a command works on."""
    fn = click.argument("journal", required=False)(fn)
    return click.option(
        "-l", "--selector", metavar="SELECTOR",
        help='Label selector instead of a JOURNAL, e.g. "app=x, name:prefix=logs/".',
    )(fn)


class DurationType(click.ParamType):
    """A Go-style duration ("90s", "1h30m") or a number of seconds."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> timedelta:
        try:
            return parse_duration(value)
        except ValueError as err:
            self.fail(str(err), param, ctx)


class TimeType(click.ParamType):
    """A point in time: RFC 3339 ("2024-05-01T12:00:00Z"), epoch seconds, or a duration ago."""

    name = "time"

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> int:
        text = str(value).strip()
        if text.isdigit():
            if int(text) > MAX_OFFSET:
                self.fail(f"{text} seconds is no time", param, ctx)
            return int(text)
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            pass
        else:
            return int((moment if moment.tzinfo else moment.astimezone(UTC)).timestamp())
        try:
            return int(time.time() - parse_duration(text).total_seconds())
        except ValueError:
            self.fail(f"{text!r} is not a time (RFC 3339, epoch seconds, or a duration ago "
                      "such as 2h)", param, ctx)


def _name_selector(name: str) -> pb.LabelSelector:
    return pb.LabelSelector(include=label_set(("name", name)))


async def resolve_journals(client: BrokerClient, journal: str | None,
                           selector: str | None) -> list[Listed]:
    """The journals named by a JOURNAL argument or matched by a selector (not both)."""
    if (journal is None) == (selector is None):
        raise CliError("name one JOURNAL or give a -l SELECTOR", DATA_ERROR)
    if journal is not None:
        if problem := journal_name_problem(journal):
            raise CliError(f"invalid journal name: {problem}", DATA_ERROR)
        found = await list_journals(client, _name_selector(journal))
        if not found:
            raise CliError(f"journal {journal} not found (JOURNAL_NOT_FOUND)")
        return found
    parsed = parse_selector(selector or "")
    found = await list_journals(client, parsed)
    if not found:
        raise CliError(f"no journal matches selector {selector!r}")
    return found


# --- the group ------------------------------------------------------------------


@click.group()
def journals() -> None:
    """List, create, append to, read and prune journals."""


@journals.command("list")
@click.option("-l", "--selector", metavar="SELECTOR", default="",
              help="Label selector; all journals if omitted.")
@click.option("-o", "--output", type=click.Choice(FORMATS), default="table", show_default=True,
              help="yaml is the spec-file form (with revisions) that `apply` takes back.")
@click.option("--primary", is_flag=True, help="Add a column with each journal's primary broker.")
@broker_option
@security_options()
@async_command()
async def list_cmd(selector: str, output: str, primary: bool, broker: str,
                   security: Security) -> None:
    """List journals and their specs."""
    parsed = parse_selector(selector)
    async with BrokerClient(broker, security) as client:
        listed = await list_journals(client, parsed)
    if output == "yaml":
        entries = [SpecEntry(JournalSpec.from_proto(j.spec), j.mod_revision) for j in listed]
        click.echo(dump_specs(entries), nl=False)
    elif output == "json":
        echo_json([_journal_json(j) for j in listed])
    else:
        header = ["NAME", "LABELS", "CODEC", "LENGTH", "STORES", "REVISION"]
        rows = [_journal_row(j, primary) for j in listed]
        echo_table([*header, "PRIMARY"] if primary else header, rows)


def _primary(route: pb.Route) -> str:
    if not 0 <= route.primary < len(route.members):
        return "(none)"
    member = route.members[route.primary]
    endpoint = route.endpoints[route.primary] if route.primary < len(route.endpoints) else ""
    name = f"{member.zone}/{member.suffix}"
    return f"{name} ({endpoint})" if endpoint else name


def _journal_row(journal: Listed, primary: bool) -> list[object]:
    spec, fragment = journal.spec, journal.spec.fragment
    row: list[object] = [
        spec.name,
        format_labels(spec.labels) or "-",
        pb.CompressionCodec.Name(fragment.compression_codec),
        format_size(fragment.length),
        ",".join(fragment.stores) or "-",
        journal.mod_revision,
    ]
    return [*row, _primary(journal.route)] if primary else row


def _journal_json(journal: Listed) -> dict[str, Any]:
    return {
        "name": journal.spec.name,
        "mod_revision": journal.mod_revision,
        "create_revision": journal.create_revision,
        "spec": JournalSpec.from_proto(journal.spec).model_dump(mode="json"),
        "primary": _primary(journal.route),
    }


@journals.command("apply")
@click.option("--specs", "specs_path", required=True, metavar="FILE",
              help='YAML spec file ("-" for stdin), as `list -o yaml` prints.')
@click.option("--dry-run", is_flag=True, help="Show what would change; change nothing.")
@click.option("--upsert", is_flag=True,
              help="Skip revision checks (as if every node had revision: -1).")
@click.option("--max-txn-size", type=click.IntRange(min=0), default=0, show_default=True,
              help="Apply in transactions of at most N changes (0: one transaction).")
@broker_option
@security_options()
@async_command()
async def apply_cmd(specs_path: str, dry_run: bool, upsert: bool, max_txn_size: int,
                    broker: str, security: Security) -> None:
    """Create, update or delete journals to match a spec file.

    A node's revision is the journal's mod revision the file was edited from:
    0 creates the journal, -1 skips the check. If a journal changed since, the
    whole apply fails and nothing is written. With --max-txn-size, transactions
    before a failing one stay applied: the error names what was and wasn't, and
    applying the same file again does the rest.
    """
    entries = read_spec_file(specs_path)
    async with BrokerClient(broker, security) as client:
        await apply_specs(client, entries, dry_run=dry_run, upsert=upsert,
                          max_txn_size=max_txn_size)


@contextlib.contextmanager
def opened_input(path: str) -> Iterator[IO[bytes]]:
    """The bytes to append: stdin for "-", else the named file."""
    if path == "-":
        yield sys.stdin.buffer
        return
    try:
        source = open(path, "rb")  # noqa: SIM115 (closed below; open errors are reported)
    except OSError as err:
        raise CliError(f"cannot read input {path}: {err.strerror}", DATA_ERROR) from None
    with source:
        yield source


@journals.command("append")
@targets_option
@click.option("-i", "--input", "input_path", default="-", show_default=True, metavar="FILE",
              help='File to append ("-" for stdin).')
@click.option("-f", "--framing", type=click.Choice(["none", "lines"]), default="none",
              show_default=True,
              help="none: the whole input is one append to one journal; "
                   "lines: each line is a record appended whole.")
@click.option("-m", "--mapping", type=click.Choice(MAPPINGS), default="random",
              show_default=True,
              help="With lines: random spreads lines over the selected journals; modulo "
                   "hashes each line to a journal; direct reads lines as JOURNAL<TAB>RECORD.")
@click.option("--unpublished", "unpublished_path", default=None, metavar="FILE",
              type=click.Path(dir_okay=False, path_type=Path),
              help="If an append fails, write the input not appended to FILE (with lines: "
                   "the lines not appended, then the input not read yet): appending it with "
                   "the same options then finishes the job exactly once.")
@broker_option
@security_options()
@async_command()
async def append_cmd(journal: str | None, selector: str | None, input_path: str, framing: str,
                     mapping: str, unpublished_path: Path | None, broker: str,
                     security: Security) -> None:
    """Append stdin (or a file) to journals. A summary goes to stderr.

    If an append fails, the error says exactly what was appended: with lines,
    how many of the lines read (by journal, for those short).
    """
    if framing == "none" and mapping != "random":
        raise click.UsageError(f"--mapping {mapping} maps lines: it needs --framing lines")
    with opened_input(input_path) as source, opened_output(unpublished_path, source) as unappended:
        appending = False
        try:
            async with BrokerClient(broker, security) as client:
                names = [j.spec.name for j in await resolve_journals(client, journal, selector)]
                if framing == "none" and len(names) != 1:
                    raise CliError(
                        f"framing 'none' appends to exactly one journal, but the selector "
                        f"matches {len(names)} ({', '.join(names[:5])}"
                        f"{', …' if len(names) > 5 else ''}); use --framing lines to spread "
                        "lines over them",
                        DATA_ERROR,
                    )
                appending = True
                if framing == "lines":
                    await append_lines(client, names, source, mapping, unappended)
                else:
                    await append_raw(client, names[0], source, unappended)
        except Exception:
            if unappended is not None and not appending:  # (a broker out of reach, say)
                shutil.copyfileobj(source, unappended)
                warn(f"nothing was appended; the input is in {unappended.name}")
            raise


@journals.command("read")
@targets_option
@click.option("--offset", type=click.IntRange(min=-1, max=MAX_OFFSET), default=None,
              help="Offset to start at [default: 0]; -1 is the write head.")
@click.option("--tail", is_flag=True, help="Start at the write head (offset -1).")
@click.option("--block/--no-block", default=False, show_default=True,
              help="Follow the journals for new content until Ctrl-C.")
@click.option("--offsets", "offsets_in", type=click.Path(dir_okay=False, path_type=Path),
              help="JSON file of start offsets by journal (as --offsets-out writes).")
@click.option("--offsets-out", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the offset reached in each journal to this JSON file on exit.")
@click.option("--messages", is_flag=True,
              help="Decode messages with the journal's framing (its content-type label) and "
                   "print each as one line of JSON.")
@click.option("--committed", is_flag=True,
              help="Print only committed messages, each once (implies --messages). "
                   "Transactions begun before the start offset are not seen.")
@broker_option
@security_options()
@async_command(interrupt_exit=0)
async def read_cmd(journal: str | None, selector: str | None, offset: int | None, tail: bool,
                   block: bool, offsets_in: Path | None, offsets_out: Path | None,
                   messages: bool, committed: bool, broker: str, security: Security) -> None:
    """Copy journal content to stdout.

    Without --block, stops at each journal's write head. With several journals
    they are read one after another, or all at once with --block; journals
    labeled with a line content-type (text/*, application/x-ndjson) are
    written in whole lines. Skipped gaps are reported on stderr. With
    --messages or --committed, output is one JSON line per message.
    """
    if tail and offset not in (None, -1):
        raise CliError("--tail starts at the write head; it can't be combined with --offset",
                       DATA_ERROR)
    start = -1 if tail else offset or 0
    offsets = load_offsets(offsets_in)
    async with BrokerClient(broker, security) as client:
        specs = [j.spec for j in await resolve_journals(client, journal, selector)]
        await copy_journals(client, specs, offsets, default_offset=start, block=block,
                            offsets_out=offsets_out, messages=messages, committed=committed)


@journals.command("fragments")
@targets_option
@click.option("--from", "from_time", type=TimeType(), default=None,
              help="Only fragments modified at or after this time (RFC 3339, epoch seconds, "
                   "or a duration ago such as 2h).")
@click.option("--to", "to_time", type=TimeType(), default=None,
              help="Only fragments modified before this time.")
@click.option("--url-ttl", type=DurationType(), default="1m", show_default=True,
              help="Lifetime of the fragments' signed URLs (0: no URLs).")
@click.option("-o", "--output", type=click.Choice(["table", "json"]), default="table",
              show_default=True)
@broker_option
@security_options()
@async_command()
async def fragments_cmd(journal: str | None, selector: str | None, from_time: int | None,
                        to_time: int | None, url_ttl: timedelta, output: str,
                        broker: str, security: Security) -> None:
    """List the fragments of journals: local spools and persisted files."""
    async with BrokerClient(broker, security) as client:
        names = [j.spec.name for j in await resolve_journals(client, journal, selector)]
        rows = await fragment_rows(client, names, begin_mod_time=from_time or 0,
                                   end_mod_time=to_time or 0, url_ttl=url_ttl)
    print_fragments(rows, output)


@journals.command("prune")
@click.option("-l", "--selector", metavar="SELECTOR", required=True,
              help='Label selector of the journals to prune ("" for all).')
@click.option("--dry-run", is_flag=True, help="List what would be deleted; delete nothing.")
@click.option("--file-root", type=click.Path(file_okay=False, path_type=Path),
              default=DEFAULT_FILE_ROOT, show_default=True,
              help="Where file:/// stores live: the broker's --file-root.")
@broker_option
@security_options()
@async_command()
async def prune_cmd(selector: str, dry_run: bool, file_root: Path, broker: str,
                    security: Security) -> None:
    """Delete persisted fragments older than each journal's fragment.retention.

    Journals with retention 0 keep everything. Fragments still local to the
    broker, and each journal's last persisted fragment, are never deleted.
    """
    async with BrokerClient(broker, security) as client:
        listed = await resolve_journals(client, None, selector)
        await prune_journals(client, [j.spec for j in listed], file_root, dry_run=dry_run)
