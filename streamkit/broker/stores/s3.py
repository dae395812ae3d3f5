"""The `s3://` fragment store, for AWS S3 and S3-compatible servers.

URL form, as in Gazette: `s3://bucket/prefix/?endpoint=…&region=…&profile=…`,
plus optional `acl`, `storageclass`, `sse` and `ssekmskeyid`. Credentials come
from boto3's usual chain (environment, shared files, instance roles), or
from the named `profile`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast
from urllib.parse import urlsplit

import boto3
from boto3.exceptions import S3UploadFailedError
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from streamkit.protocol import pb
from streamkit.protocol.fragments import content_path
from streamkit.tasks import on_thread

from .base import CONTENT_TYPES, FragmentStore, FragmentStoreError, store_args, translate_errors

__all__ = ["S3Store"]

T = TypeVar("T")

# S3 calls run on threads of their own (see FragmentStore.in_thread), a pool per endpoint,
# so that one that accepts but never answers holds up no other; they give up on it.
_THREADS_PER_ENDPOINT = 16
_POOLS: dict[str, ThreadPoolExecutor] = {}
_CONNECT_TIMEOUT, _READ_TIMEOUT = 5.0, 30.0  # seconds

_ERRORS = (BotoCoreError, ClientError, S3UploadFailedError)  # the last from upload_file
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
# URL argument -> upload_file ExtraArgs key, for the options applied to new fragments.
_UPLOAD_ARGS = {
    "acl": "ACL",
    "storageclass": "StorageClass",
    "sse": "ServerSideEncryption",
    "ssekmskeyid": "SSEKMSKeyId",
}


def _pool(endpoint: str) -> ThreadPoolExecutor:
    """The threads of calls to `endpoint` (a URL, or AWS's region), made on first use."""
    pool = _POOLS.get(endpoint)
    if pool is None:
        pool = _POOLS[endpoint] = ThreadPoolExecutor(max_workers=_THREADS_PER_ENDPOINT,
                                                     thread_name_prefix="s3-store")
    return pool


def _error_code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


class S3Store(FragmentStore):
    """Fragments as objects under a bucket prefix."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        parts = urlsplit(url)
        args = store_args(parts, allowed=("endpoint", "region", "profile", *_UPLOAD_ARGS))
        if parts.scheme != "s3" or not parts.netloc:
            raise FragmentStoreError(f"{url}: an S3 store URL looks like s3://bucket/prefix/")
        if parts.path and not parts.path.endswith("/"):
            raise FragmentStoreError(f"{url}: a store URL's path must end in '/'")
        self.bucket = parts.netloc
        self.prefix = parts.path.lstrip("/")
        self._upload_args = {_UPLOAD_ARGS[k]: v for k, v in args.items() if k in _UPLOAD_ARGS}
        endpoint = args.get("endpoint") or None
        # Custom endpoints (MinIO, Ceph, test servers) rarely have per-bucket DNS names.
        config = Config(
            signature_version="s3v4",
            s3={"addressing_style": "path"} if endpoint else {},
            retries={"mode": "standard"},
            # botocore waits 60 s by default: a hung endpoint held calls for minutes.
            connect_timeout=_CONNECT_TIMEOUT,
            read_timeout=_READ_TIMEOUT,
        )
        with translate_errors(self, "configuring the client", _ERRORS):
            session = boto3.session.Session(
                profile_name=args.get("profile") or None, region_name=args.get("region") or None
            )
            self._client = session.client("s3", endpoint_url=endpoint, config=config)
        self._threads = _pool(endpoint or f"aws:{session.region_name}")

    def _key(self, f: pb.Fragment) -> str:
        return self.prefix + content_path(f)

    async def _call(self, action: str, method: str, **kwargs: Any) -> Any:
        """Run one client method in a thread, with its errors as FragmentStoreError."""
        with translate_errors(self, action, _ERRORS):
            return await self.in_thread(functools.partial(getattr(self._client, method),
                                                          **kwargs))

    async def list(self, journal: str, postfix_template: str | None = None) -> list[pb.Fragment]:
        return await self.in_thread(self._list, journal, postfix_template)

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await on_thread(self._threads, fn, *args)

    def _list(self, journal: str, postfix_template: str | None) -> list[pb.Fragment]:
        prefix = f"{self.prefix}{journal}/"
        # Without a template, "subfolders" are other journals': don't list them.
        delimiter = {"Delimiter": "/"} if postfix_template == "" else {}
        entries = []
        with translate_errors(self, f"listing {journal}", _ERRORS):
            pages = self._client.get_paginator("list_objects_v2")
            for page in pages.paginate(Bucket=self.bucket, Prefix=prefix, **delimiter):
                for obj in page.get("Contents", ()):
                    if not obj["Key"].endswith("/"):  # skip "directory" marker objects
                        relative = obj["Key"][len(prefix) :]
                        entries.append((relative, int(obj["LastModified"].timestamp())))
        return self._collect(journal, entries, postfix_template)

    async def exists(self, f: pb.Fragment) -> bool:
        key = self._key(f)
        try:
            await self._call(f"checking {key}", "head_object", Bucket=self.bucket, Key=key)
        except FragmentStoreError as e:
            cause = e.__cause__
            if isinstance(cause, ClientError) and _error_code(cause) in _NOT_FOUND:
                return False
            raise
        return True

    async def put(self, f: pb.Fragment, compressed_path: Path) -> None:
        if await self.exists(f):
            return
        extra = {"ContentType": CONTENT_TYPES[f.compression_codec], **self._upload_args}
        if f.compression_codec == pb.GZIP_OFFLOAD_DECOMPRESSION:
            extra["ContentEncoding"] = "gzip"
        key = self._key(f)
        # upload_file switches to a multipart upload for large files.
        await self._call(
            f"writing {key}",
            "upload_file",
            Filename=str(compressed_path),
            Bucket=self.bucket,
            Key=key,
            ExtraArgs=extra,
        )

    def open(self, f: pb.Fragment) -> BinaryIO:
        key = self._key(f)
        with translate_errors(self, f"opening {key}", _ERRORS):
            response = self._client.get_object(Bucket=self.bucket, Key=key)
        return cast(BinaryIO, response["Body"])

    async def signed_url(self, f: pb.Fragment, ttl: timedelta) -> str:
        key = self._key(f)
        return cast(
            str,
            await self._call(
                f"signing {key}",
                "generate_presigned_url",
                ClientMethod="get_object",
                Params={"Bucket": self.bucket, "Key": key},
                ExpiresIn=max(1, int(ttl.total_seconds())),
            ),
        )

    async def remove(self, f: pb.Fragment) -> None:
        key = self._key(f)
        await self._call(f"removing {key}", "delete_object", Bucket=self.bucket, Key=key)
