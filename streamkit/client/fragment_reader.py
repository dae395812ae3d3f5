"""Reading persisted fragments directly from their store, without the broker in the path.

A Read with `do_not_proxy` answers with the fragment's URL instead of its
bytes; the client then fetches and decompresses the file itself, which spares
the broker the work. `file://` URLs are relative to a fragment root the client
names (the broker's `--data-dir`/fragments, or a shared NAS mount), never to
the machine's `/`, as with Gazette's InstallFileTransport.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

from streamkit.client.errors import FragmentError
from streamkit.protocol import pb
from streamkit.protocol.codecs import open_decompressed
from streamkit.protocol.fragments import content_name

__all__ = ["FragmentReader", "open_fragment"]

_SKIP_STEP = 1 << 20
_HTTP_TIMEOUT = 30.0


def _describe(f: pb.Fragment) -> str:
    try:
        return f"{f.journal}/{content_name(f)}"
    except ValueError:
        return f"{f.journal}@[{f.begin}, {f.end})"


class FragmentReader:
    """Decompressed bytes of one fragment from `offset` on, checked against its span.

    It fails with FragmentError when the file yields fewer or more bytes than
    `fragment.end - fragment.begin`, so a truncated or mismatched file is
    never silently taken for journal content.
    """

    def __init__(self, raw: BinaryIO, fragment: pb.Fragment, offset: int, codec: int) -> None:
        if not fragment.begin <= offset <= fragment.end:
            raw.close()
            raise ValueError(f"offset {offset} is outside fragment {_describe(fragment)}")
        self.fragment = fragment
        self.offset = fragment.begin
        self._stream = open_decompressed(raw, codec)
        self._checked_end = False
        try:
            self._skip(offset - fragment.begin)
        except BaseException:
            self.close()
            raise

    def _skip(self, count: int) -> None:
        while count > 0:
            skipped = len(self.read(min(count, _SKIP_STEP)))
            count -= skipped

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        """Up to `size` bytes (all that remain if negative); b"" at the fragment's end."""
        remaining = self.fragment.end - self.offset
        if remaining <= 0 or size == 0:
            self._check_end()
            return b""
        data = self._stream.read(remaining if size < 0 else min(size, remaining))
        if not data:
            raise FragmentError(
                f"fragment {_describe(self.fragment)} ended at offset {self.offset}, "
                f"short of its end {self.fragment.end}"
            )
        self.offset += len(data)
        if self.offset == self.fragment.end:
            self._check_end()
        return data

    def _check_end(self) -> None:
        if not self._checked_end:
            self._checked_end = True
            if self._stream.read(1):
                raise FragmentError(
                    f"fragment {_describe(self.fragment)} has content past its end "
                    f"{self.fragment.end}"
                )

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> FragmentReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _file_path(url: str, file_root: Path | None) -> Path:
    """The local path of a file:// fragment URL under `file_root`."""
    if file_root is None:
        raise ValueError(f"reading {url} needs a file_root (the store's root directory)")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{url}: file URLs with a host are not supported")
    root = file_root.resolve()
    path = (root / unquote(parts.path).lstrip("/")).resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"{url} points outside the fragment root {root}")
    return path


def _open_http(url: str, fragment: pb.Fragment) -> tuple[BinaryIO, int]:
    """GET the fragment; returns the body and the codec its bytes are actually in."""
    # Identity encoding: a store holding GZIP_OFFLOAD_DECOMPRESSION content
    # (uploaded with Content-Encoding: gzip) then decompresses it for us.
    import urllib.request  # here: ~10 ms of imports a member without URL stores never needs

    request = urllib.request.Request(url, headers={"Accept-Encoding": "identity"})
    response = urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT)
    codec = fragment.compression_codec
    if codec == pb.GZIP_OFFLOAD_DECOMPRESSION:
        encoding = (response.headers.get("Content-Encoding") or "").lower()
        codec = pb.GZIP if encoding == "gzip" else pb.NONE
    return response, codec


def open_fragment(
    fragment: pb.Fragment, url: str, file_root: Path | None, offset: int
) -> FragmentReader:
    """Open `fragment` at `url` and position it at journal `offset` (blocking: run in a thread)."""
    scheme = urlsplit(url).scheme
    if scheme == "file":
        raw: BinaryIO = open(_file_path(url, file_root), "rb")  # noqa: SIM115 (owned by the reader)
        codec = fragment.compression_codec
    elif scheme in ("http", "https"):
        raw, codec = _open_http(url, fragment)
    else:
        raise ValueError(f"{url}: cannot read fragments over {scheme or 'a scheme-less'} URL")
    return FragmentReader(raw, fragment, offset, codec)
