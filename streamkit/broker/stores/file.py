"""The `file://` fragment store: fragments as files under the broker's file root.

`file:///x/y/` maps to `<file root>/x/y/`, never to the machine's `/`, so a
JournalSpec can't make the broker read or write outside its data folder.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit

from streamkit.protocol import pb
from streamkit.protocol.fragments import content_path, fragment_url

from .base import FragmentStore, FragmentStoreError, store_args, translate_errors

__all__ = ["FileStore"]

# Files being written start with this; listings skip them without a warning.
TEMP_PREFIX = ".streamkit-tmp-"
_COPY_BUFFER = 1 << 20


def _clean_parts(relative: str, what: str) -> list[str]:
    """The components of a relative path, refusing anything that could escape its root."""
    parts = relative.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise FragmentStoreError(f"{what} {relative!r} is not a clean relative path")
    return parts


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(path: Path) -> None:
    """Like mkdir -p, but also makes each new directory's entry durable."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            continue
        _fsync_dir(directory.parent)


def _stage(source: Path, temp: Path) -> None:
    """Put a durable copy of `source` at `temp`: a hard link if possible, else a copy."""
    try:
        os.link(source, temp)
    except OSError:
        with open(temp, "xb") as out, open(source, "rb") as src:
            shutil.copyfileobj(src, out, _COPY_BUFFER)
    fd = os.open(temp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileStore(FragmentStore):
    """Fragments as files in a local (or mounted) file system."""

    def __init__(self, url: str, file_root: Path) -> None:
        super().__init__(url)
        parts = urlsplit(url)
        if parts.scheme != "file" or parts.netloc:
            raise FragmentStoreError(f"{url}: a file store URL looks like file:///some/folder/")
        store_args(parts, allowed=())
        if not parts.path.endswith("/"):
            raise FragmentStoreError(f"{url}: a store URL's path must end in '/'")
        relative = parts.path.strip("/")
        self.root = file_root
        if relative:
            self.root = file_root.joinpath(*_clean_parts(relative, "store path"))

    def _path(self, f: pb.Fragment) -> Path:
        return self.root.joinpath(*_clean_parts(content_path(f), "fragment path"))

    async def list(self, journal: str, postfix_template: str | None = None) -> list[pb.Fragment]:
        return await asyncio.to_thread(self._list, journal, postfix_template)

    def _list(self, journal: str, postfix_template: str | None) -> list[pb.Fragment]:
        folder = self.root.joinpath(*_clean_parts(journal, "journal name"))
        # Without a template, subfolders are other journals': don't walk them.
        entries = self._walk(folder, recursive=postfix_template != "")
        with translate_errors(self, f"listing {journal}", (OSError,)):
            return self._collect(journal, entries, postfix_template)

    @staticmethod
    def _walk(folder: Path, recursive: bool) -> Iterator[tuple[str, int]]:
        """(path relative to `folder`, mod time) of every file in it (and below it)."""

        def fail(e: OSError) -> None:
            if not isinstance(e, FileNotFoundError):  # a missing folder is an empty listing
                raise e

        for directory, subfolders, names in os.walk(folder, onerror=fail):
            if not recursive:
                subfolders.clear()
            for name in names:
                if name.startswith(TEMP_PREFIX):
                    continue
                path = os.path.join(directory, name)
                try:
                    mod_time = int(os.stat(path).st_mtime)
                except FileNotFoundError:  # removed while listing
                    continue
                yield os.path.relpath(path, folder).replace(os.sep, "/"), mod_time

    async def exists(self, f: pb.Fragment) -> bool:
        return await asyncio.to_thread(self._path(f).exists)

    async def put(self, f: pb.Fragment, compressed_path: Path) -> None:
        await asyncio.to_thread(self._put, f, compressed_path)

    def _put(self, f: pb.Fragment, compressed_path: Path) -> None:
        """Stage under a temporary name, sync, then rename: readers never see a partial file.

        Staging hard-links the caller's file when it is on the same file system
        (the broker's scratch dir usually is), which saves copying the fragment.
        """
        target = self._path(f)
        if target.exists():
            return
        with translate_errors(self, f"writing {target.name}", (OSError,)):
            _make_dirs(target.parent)
            temp = Path(tempfile.mktemp(prefix=TEMP_PREFIX, dir=target.parent))
            try:
                _stage(compressed_path, temp)
                os.chmod(temp, 0o644)
                os.replace(temp, target)
            except BaseException:
                temp.unlink(missing_ok=True)
                raise
            _fsync_dir(target.parent)

    def open(self, f: pb.Fragment) -> BinaryIO:
        path = self._path(f)
        with translate_errors(self, f"opening {path.name}", (OSError,)):
            return open(path, "rb")  # the caller owns and closes the stream

    async def signed_url(self, f: pb.Fragment, ttl: timedelta) -> str:
        # Like Gazette: the fragment's file:// URL, relative to the file root.
        return fragment_url(self.url, f)

    async def remove(self, f: pb.Fragment) -> None:
        path = self._path(f)
        with translate_errors(self, f"removing {path.name}", (OSError,)):
            await asyncio.to_thread(path.unlink, missing_ok=True)
