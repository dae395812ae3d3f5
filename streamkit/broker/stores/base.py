"""The FragmentStore interface and what every store implementation shares.

A store holds persisted fragments as plain files named by their content
(see streamkit.protocol.fragments), under `<store URL>/<journal>/`. Because
names are content-addressed, writes are idempotent and listings need no
other metadata.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO, TypeVar
from urllib.parse import SplitResult, parse_qsl

from streamkit.errors import StreamkitError
from streamkit.protocol import pb
from streamkit.protocol.fragments import FragmentNameError, parse_content_path

from .postfix import postfix_matcher

__all__ = ["CONTENT_TYPES", "FragmentStore", "FragmentStoreError", "store_args", "translate_errors"]

T = TypeVar("T")

log = logging.getLogger(__name__)

# Content-Type of stored objects. An offloaded-gzip fragment is stored with
# `Content-Encoding: gzip` instead, so HTTP clients see its plain content.
CONTENT_TYPES: dict[int, str] = {
    pb.NONE: "application/octet-stream",
    pb.GZIP: "application/gzip",
    pb.ZSTANDARD: "application/zstd",
    pb.SNAPPY: "application/x-snappy-framed",
    pb.GZIP_OFFLOAD_DECOMPRESSION: "application/octet-stream",
}


class FragmentStoreError(StreamkitError):
    """A fragment store URL is invalid, or the store failed an operation (named in the message).

    The name says which store: a shard's state store raises `streamkit.stores.StoreError`."""


class FragmentStore(ABC):
    """Persisted fragments of journals, under one store URL.

    Async methods run blocking I/O in worker threads. `open` is blocking:
    callers read fragments in a thread, usually through
    `streamkit.protocol.codecs.open_decompressed`.
    """

    def __init__(self, url: str) -> None:
        # Exactly as written in the JournalSpec: listed fragments carry it as backing_store.
        self.url = url

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` (blocking calls of this store, `open` and reading what it returned)
        in a worker thread. A remote store has threads of its own, so that one that hangs
        holds none of the others'."""
        return await asyncio.to_thread(fn, *args)

    @abstractmethod
    async def list(self, journal: str, postfix_template: str | None = None) -> list[pb.Fragment]:
        """Every fragment of `journal` in the store, ordered by (begin, end).

        `postfix_template` is the journal's `path_postfix_template`: files in
        subfolders count only if the template can produce that subfolder path,
        since the journal's folder also holds the folders of journals nested
        below it. None (a caller that doesn't know the spec) takes every
        subfolder, as Gazette's listings do.
        """

    @abstractmethod
    async def exists(self, f: pb.Fragment) -> bool:
        """Whether the store holds fragment `f`."""

    @abstractmethod
    async def put(self, f: pb.Fragment, compressed_path: Path) -> None:
        """Store the compressed file of `f`; a no-op if the store already has it.

        The store may adopt the file itself (a hard link), so callers may delete
        `compressed_path` afterwards but must never modify it in place.
        """

    @abstractmethod
    def open(self, f: pb.Fragment) -> BinaryIO:
        """The stored (still compressed) bytes of `f`, as a blocking readable stream."""

    @abstractmethod
    async def signed_url(self, f: pb.Fragment, ttl: timedelta) -> str:
        """A URL from which the bearer may GET the stored bytes of `f` for `ttl`."""

    @abstractmethod
    async def remove(self, f: pb.Fragment) -> None:
        """Delete `f` from the store; a no-op if it is already gone."""

    def _collect(
        self, journal: str, entries: Iterable[tuple[str, int]], postfix_template: str | None
    ) -> list[pb.Fragment]:
        """Fragments from (path relative to the journal's folder, mod time) pairs.

        Files whose names don't parse are skipped with a warning, as Gazette does,
        so stray files can't break the fragment index. Files in subfolders the
        template can't produce belong to other journals (or to none): skipped quietly.
        """
        fits = postfix_matcher(postfix_template) if postfix_template is not None else None
        fragments = []
        for relative, mod_time in entries:
            postfix = relative.rpartition("/")[0]
            if postfix and fits is not None and not fits(postfix):
                log.debug("listing %s in %s: %s is not one of its files", journal, self.url,
                          relative)
                continue
            try:
                f = parse_content_path(journal, relative)
            except FragmentNameError as e:
                log.warning("skipping a file that is not a fragment in %s: %s", self.url, e)
                continue
            f.backing_store = self.url
            f.mod_time = mod_time
            fragments.append(f)
        fragments.sort(key=lambda f: (f.begin, f.end))
        return fragments

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def store_args(url: SplitResult, allowed: Iterable[str]) -> dict[str, str]:
    """The query arguments of a store URL, lower-cased, refusing unknown ones.

    Gazette reads store options from the URL query too; refusing typos beats
    silently ignoring an option such as an endpoint.
    """
    allowed = set(allowed)
    args: dict[str, str] = {}
    for name, value in parse_qsl(url.query, keep_blank_values=True, strict_parsing=False):
        key = name.lower()
        if key not in allowed:
            known = ", ".join(sorted(allowed)) or "none"
            raise FragmentStoreError(
                f"{url.geturl()}: unknown query argument {name!r} (known: {known})"
            )
        if key in args:
            raise FragmentStoreError(f"{url.geturl()}: query argument {name!r} is given twice")
        args[key] = value
    return args


@contextmanager
def translate_errors(
    store: FragmentStore, action: str, errors: tuple[type[BaseException], ...]
) -> Iterator[None]:
    """Re-raise a backend's `errors` as FragmentStoreError, naming the store and the action."""
    try:
        yield
    except errors as e:
        raise FragmentStoreError(f"{store.url}: {action}: {e}") from e
