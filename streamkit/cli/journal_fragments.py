"""`journals fragments` and `journals prune`: the persisted history of journals.

The broker never deletes fragments (as in Gazette): retention is enforced
by running `prune`, which removes persisted fragments older than each
journal's `fragment.retention` straight from the stores. Two fragments are
always kept: anything still local to the broker (it is not in a store yet),
and the journal's last persisted fragment, which records how far the journal
got. Without it, a broker that lost its local spools would restart the
journal's offsets below content readers have already seen.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import click

from streamkit.broker.stores import open_store
from streamkit.cli.errors import CliError, warn
from streamkit.cli.output import echo_json, echo_table, format_mod_time, format_size, plural
from streamkit.client import BrokerClient, list_fragments
from streamkit.protocol import pb
from streamkit.protocol.fragments import content_name, digest_of, fragment_url

__all__ = ["FragmentRow", "Removal", "fragment_rows", "print_fragments", "prune_journals"]


@dataclass(frozen=True)
class FragmentRow:
    """One fragment of a listing, and the URL to read it by (if signed)."""

    fragment: pb.Fragment
    url: str

    def as_json(self) -> dict[str, Any]:
        f = self.fragment
        return {
            "journal": f.journal,
            "begin": f.begin,
            "end": f.end,
            "size": f.end - f.begin,
            "sha1": digest_of(f.sum).hex(),
            "compression_codec": pb.CompressionCodec.Name(f.compression_codec),
            "backing_store": f.backing_store,
            "path_postfix": f.path_postfix,
            "mod_time": f.mod_time,
            "url": self.url,
        }

    def as_cells(self) -> list[object]:
        f = self.fragment
        return [
            f.journal,
            f.begin,
            f.end,
            format_size(f.end - f.begin),
            pb.CompressionCodec.Name(f.compression_codec),
            f.backing_store or "(local)",
            format_mod_time(f.mod_time),
            self.url or "-",
        ]


_HEADER = ("JOURNAL", "BEGIN", "END", "SIZE", "CODEC", "STORE", "MOD TIME", "URL")


async def fragment_rows(
    client: BrokerClient,
    journals: list[str],
    *,
    begin_mod_time: int = 0,
    end_mod_time: int = 0,
    url_ttl: timedelta | None = None,
) -> list[FragmentRow]:
    """Fragments of each journal, in journal then offset order."""
    rows = []
    for journal in journals:
        response = await list_fragments(
            client, journal, begin_mod_time, end_mod_time, url_ttl or None
        )
        rows.extend(FragmentRow(item.spec, item.signed_url) for item in response.fragments)
    return rows


def print_fragments(rows: list[FragmentRow], output: str) -> None:
    if output == "json":
        echo_json([row.as_json() for row in rows])
    else:
        echo_table(_HEADER, (row.as_cells() for row in rows))


def expired(fragments: list[pb.Fragment], retention: timedelta, now: float) -> list[pb.Fragment]:
    """The persisted fragments older than `retention`, except the last persisted one(s)."""
    persisted = [f for f in fragments if f.backing_store]
    if not retention or not persisted:
        return []
    last_end = max(f.end for f in persisted)
    cutoff = now - retention.total_seconds()
    return [f for f in persisted if f.end < last_end and f.mod_time < cutoff]


class Removal:
    """Deletes fragments from their stores (or, dry, only finds them), tallying what it
    deleted and what it did not find: a few already gone are said; none found at all is
    a wrong --file-root, an error (it passed as "deleted 0 fragments")."""

    def __init__(self, file_root: Path, *, dry_run: bool) -> None:
        self.file_root = file_root
        self.dry_run = dry_run
        self.verb = "would delete" if dry_run else "deleted"
        self.count = self.size = 0
        self.missing: list[str] = []

    async def remove(self, fragment: pb.Fragment) -> bool:
        """Delete one fragment; False if it isn't there."""
        store = open_store(fragment.backing_store, self.file_root)
        if not await store.exists(fragment):
            self.missing.append(fragment_url(fragment.backing_store, fragment))
            return False
        if not self.dry_run:
            await store.remove(fragment)
        self.count += 1
        self.size += fragment.end - fragment.begin
        return True

    def check(self) -> None:
        """Say which fragments were not found; raise CliError if none was."""
        if not self.missing:
            return
        what = (f"{plural(len(self.missing), 'fragment')} listed by the broker "
                f"{'was' if len(self.missing) == 1 else 'were'} not found, e.g. "
                f"{self.missing[0]}")
        if any(url.startswith("file://") for url in self.missing):
            what += f" (is --file-root {self.file_root} the broker's?)"
        self.missing.clear()
        if not self.count:
            raise CliError(what)
        warn(f"{what}; already gone?")


async def prune_journals(
    client: BrokerClient,
    journals: list[pb.JournalSpec],
    file_root: Path,
    *,
    dry_run: bool,
) -> None:
    """Delete (or list, with `dry_run`) the expired fragments of `journals`."""
    removal = Removal(file_root, dry_run=dry_run)
    now = time.time()
    for spec in journals:
        retention = spec.fragment.retention.ToTimedelta()
        listed = await list_fragments(client, spec.name)
        for fragment in expired([item.spec for item in listed.fragments], retention, now):
            if await removal.remove(fragment):
                click.echo(
                    f"{removal.verb} {spec.name} [{fragment.begin}, {fragment.end}) "
                    f"{fragment.backing_store} {content_name(fragment)} "
                    f"(modified {format_mod_time(fragment.mod_time)})"
                )
    click.echo(
        f"{removal.verb} {plural(removal.count, 'fragment')} ({plural(removal.size, 'byte')} "
        f"of journal content) of {plural(len(journals), 'journal')}"
    )
    removal.check()
