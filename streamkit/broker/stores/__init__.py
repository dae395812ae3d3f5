"""Fragment stores: where the broker persists fragments and lists them back.

`open_store` maps a store URL from a JournalSpec to its FragmentStore.
"""

from __future__ import annotations

import functools
from pathlib import Path
from urllib.parse import urlsplit

from .base import CONTENT_TYPES, FragmentStore, FragmentStoreError
from .file import FileStore

__all__ = ["CONTENT_TYPES", "FileStore", "FragmentStore", "FragmentStoreError", "open_store"]

_NOT_YET = ("gs", "azure", "azure-ad")


def open_store(url: str, file_root: Path) -> FragmentStore:
    """The store of `url`, one instance per URL (and file root, for file stores).

    `file_root` is the broker's --file-root: `file:///x/` URLs live below it.
    """
    scheme = urlsplit(url).scheme
    root = file_root.resolve() if scheme == "file" else None
    return _open(url, root)


@functools.cache
def _open(url: str, file_root: Path | None) -> FragmentStore:
    scheme = urlsplit(url).scheme
    if scheme == "file":
        assert file_root is not None
        return FileStore(url, file_root)
    if scheme == "s3":
        from .s3 import S3Store  # boto3 is slow to import; load it only when used

        return S3Store(url)
    if scheme in _NOT_YET:
        raise FragmentStoreError(
            f"{url}: {scheme}:// stores are not supported by the bundled broker yet"
        )
    raise FragmentStoreError(f"{url}: unknown fragment store scheme {scheme!r} (use file:// or s3://)")
