"""Fragment naming: SHA-1 sums, file extensions, content names and paths.

A persisted fragment is a plain file whose name alone describes it
(`<begin:016x>-<end:016x>-<sha1><ext>`), so anything that can list a directory
or a bucket can rebuild the fragment index without the broker. The broker,
the client and offline readers (Spark) all share these helpers, so the module
stays pure: no I/O and nothing beyond the generated protobuf.
"""

from __future__ import annotations

import re
import struct
from urllib.parse import urlsplit, urlunsplit

from streamkit.errors import StreamkitError
from streamkit.protocol import broker_pb2 as pb
from streamkit.protocol.spec import MAX_OFFSET

__all__ = [
    "EXTENSIONS",
    "FragmentNameError",
    "content_name",
    "content_path",
    "digest_of",
    "fragment_url",
    "parse_content_name",
    "parse_content_path",
    "sum_of",
]

# Big-endian split of a 20-byte SHA-1 into the SHA1Sum fields (8 + 8 + 4 bytes).
_SUM_LAYOUT = struct.Struct(">QQI")
_STEM = re.compile(
    r"(?P<begin>[0-9a-fA-F]{1,16})-(?P<end>[0-9a-fA-F]{1,16})-(?P<sum>[0-9a-fA-F]{40})"
)

# The extension each codec writes. GZIP_OFFLOAD_DECOMPRESSION has none, so a
# store serving it with `Content-Encoding: gzip` hands out plain content.
EXTENSIONS: dict[int, str] = {
    pb.NONE: ".raw",
    pb.GZIP: ".gz",
    pb.ZSTANDARD: ".zst",
    pb.SNAPPY: ".sz",
    pb.GZIP_OFFLOAD_DECOMPRESSION: "",
}

# Every extension a reader accepts, including the long spellings and ".gzod".
_CODEC_OF_EXTENSION: dict[str, int] = {
    **{ext: codec for codec, ext in EXTENSIONS.items()},
    ".gzip": pb.GZIP,
    ".zstandard": pb.ZSTANDARD,
    ".snappy": pb.SNAPPY,
    ".gzod": pb.GZIP_OFFLOAD_DECOMPRESSION,
}


class FragmentNameError(StreamkitError, ValueError):
    """A file name is not a fragment content name (listings skip such files)."""


def sum_of(digest: bytes) -> pb.SHA1Sum:
    """Split a 20-byte SHA-1 digest into the wire's SHA1Sum."""
    if len(digest) != _SUM_LAYOUT.size:
        raise ValueError(f"a SHA-1 digest has 20 bytes, not {len(digest)}")
    part1, part2, part3 = _SUM_LAYOUT.unpack(digest)
    return pb.SHA1Sum(part1=part1, part2=part2, part3=part3)


def digest_of(s: pb.SHA1Sum) -> bytes:
    """Join a SHA1Sum back into its 20-byte digest (all zeros when unset)."""
    return _SUM_LAYOUT.pack(s.part1, s.part2, s.part3)


def content_name(f: pb.Fragment) -> str:
    """The file name of fragment `f` in a store."""
    try:
        ext = EXTENSIONS[f.compression_codec]
    except KeyError:
        raise FragmentNameError(
            f"fragment of {f.journal!r} has no valid compression codec ({f.compression_codec})"
        ) from None
    return f"{f.begin:016x}-{f.end:016x}-{digest_of(f.sum).hex()}{ext}"


def content_path(f: pb.Fragment) -> str:
    """The path of fragment `f` relative to its store's URL."""
    if f.path_postfix:
        return f"{f.journal}/{f.path_postfix}/{content_name(f)}"
    return f"{f.journal}/{content_name(f)}"


def parse_content_name(journal: str, name: str) -> pb.Fragment:
    """Parse a content name of `journal` into a Fragment (no store, no mod time)."""
    stem, dot, ext = name.partition(".")
    codec = _CODEC_OF_EXTENSION.get(dot + ext)
    if codec is None:
        raise FragmentNameError(f"{name!r}: unknown extension {dot + ext!r}")
    match = _STEM.fullmatch(stem)
    if match is None:
        raise FragmentNameError(
            f"{name!r}: expected <begin:016x>-<end:016x>-<sha1:40 hex digits><extension>"
        )
    begin, end = int(match["begin"], 16), int(match["end"], 16)
    if end > MAX_OFFSET:
        raise FragmentNameError(f"{name!r}: end offset overflows int64")
    if begin > end:
        raise FragmentNameError(f"{name!r}: begin offset is after end offset")
    return pb.Fragment(
        journal=journal,
        begin=begin,
        end=end,
        sum=sum_of(bytes.fromhex(match["sum"])),
        compression_codec=codec,
    )


def parse_content_path(journal: str, relative: str) -> pb.Fragment:
    """Parse a path relative to `<store>/<journal>/`; its directories are the path postfix."""
    postfix, _, name = relative.rpartition("/")
    f = parse_content_name(journal, name)
    if postfix:
        if any(part in ("", ".", "..") for part in postfix.split("/")):
            raise FragmentNameError(f"{relative!r}: path postfix is not a clean relative path")
        f.path_postfix = postfix
    return f


def fragment_url(store_url: str, f: pb.Fragment) -> str:
    """The URL of fragment `f` within the store at `store_url` (query kept last).

    Journal names are restricted to URL-safe characters plus `%`, `+` and `=`, and
    the content path is appended as is, as Gazette does, but for a `%` in a
    `file:` URL: readers open its path unescaped (as Gazette's do), so a journal
    named `a%20b` would be read from `a b`.
    """
    parts = urlsplit(store_url)
    path = parts.path if parts.path.endswith("/") else parts.path + "/"
    content = content_path(f)
    if parts.scheme == "file":
        content = content.replace("%", "%25")
    return urlunsplit(parts._replace(path=path + content))
