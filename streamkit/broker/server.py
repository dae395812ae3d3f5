"""The bundled broker process: gRPC Journal service, HTTP gateway, persister, ticker.

Layout of a data dir:

* ``keyspace.db``: the embedded KeySpace (journal specs), unless another is named;
* ``journals/<journal>/@spool/``: spools of each journal;
* ``fragments/``: the default ``file://`` fragment root;
* ``tmp/``: scratch space for compressing fragments.

`BrokerConfig.security` decides TLS and authorization for both the gRPC
service and the HTTP gateway; its default (loopback, plaintext, no keys)
adds nothing to any call path.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from streamkit.auth.grpc_auth import JOURNAL_CAPABILITIES
from streamkit.auth.settings import Exposed, Security, is_wildcard
from streamkit.auth.tls import TlsError
from streamkit.broker.data_lock import lock_data_dir
from streamkit.broker.journals import JournalRegistry
from streamkit.broker.pace import DEFAULT_MIN_APPEND_RATE
from streamkit.broker.persister import Persister
from streamkit.broker.replica import Replica
from streamkit.broker.service import APPEND_CHUNK_TIMEOUT, Identity, JournalService
from streamkit.errors import StreamkitError
from streamkit.keyspace import KeySpaceError, open_keyspace
from streamkit.process_limits import raise_open_file_limit
from streamkit.process_lock import ProcessLock
from streamkit.protocol import pb_grpc
from streamkit.sockets import listen
from streamkit.tasks import cancel_and_wait

if TYPE_CHECKING:
    from streamkit.broker.http import HttpGateway

log = logging.getLogger(__name__)

DEFAULT_PORT = 8080
TICK = 1.0  # seconds between flush-interval and store-refresh checks


def default_suffix() -> str:
    """This host's name, which names the broker in headers and routes. Gazette wants 4 to
    128 characters: a shorter name (a host called "vm") gets "-broker" appended."""
    host = socket.gethostname()
    return host if len(host) >= 4 else f"{host}-broker"


@dataclass
class BrokerConfig:
    data_dir: Path
    port: int = DEFAULT_PORT
    http_port: int | None = None  # default: port + 1; 0 disables the gateway
    host: str = "127.0.0.1"
    advertise: str | None = None  # the host others reach it by (default: host, or hostname)
    file_root: Path | None = None
    keyspace: str | None = None
    zone: str = "local"
    suffix: str = field(default_factory=default_suffix)
    shutdown_grace: float = 5.0
    append_timeout: float = APPEND_CHUNK_TIMEOUT
    min_append_rate: float = DEFAULT_MIN_APPEND_RATE
    security: Security = field(default_factory=Security)

    @property
    def fragment_root(self) -> Path:
        return self.file_root or self.data_dir / "fragments"

    @property
    def gateway_port(self) -> int:
        return self.port + 1 if self.http_port is None else self.http_port


class Broker:
    """Owns every component of one broker process; `run` serves until stopped."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self._stopping = asyncio.Event()
        self._tick_failed: set[str] = set()  # journals whose last periodic roll failed
        self.persister = Persister(config.data_dir / "tmp")
        self.registry: JournalRegistry
        self.server: grpc.aio.Server
        self.gateway: HttpGateway | None = None
        self._gateway_task: asyncio.Task[None] | None = None
        self._gateway_sock: socket.socket | None = None
        self._refreshed: dict[str, float] = {}
        # Listings in flight, by journal: each its own task, so that a store that hangs
        # delays neither the other journals' listings nor the ticker's rolls.
        self._refreshing: dict[str, asyncio.Task[None]] = {}
        self._data_lock: ProcessLock | None = None  # one broker per data dir (data_lock.py)

    def request_stop(self) -> None:
        self._stopping.set()

    async def start(self) -> None:
        cfg = self.config
        cfg.security.check_exposure(cfg.host, cfg.port, "the broker")
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self._data_lock = lock_data_dir(cfg.data_dir, self._local_address())  # before reading it
        cfg.fragment_root.mkdir(parents=True, exist_ok=True)
        keyspace = open_keyspace(cfg.keyspace or str(cfg.data_dir / "keyspace.db"))
        self.registry = JournalRegistry(
            keyspace, cfg.data_dir, cfg.fragment_root, self.persister.enqueue
        )
        self.persister.start()
        await self.registry.start()
        endpoint = cfg.security.endpoint(cfg.advertise or cfg.host, cfg.port)
        for concern in cfg.security.certificate_concerns(cfg.advertise or cfg.host):
            log.warning("%s", concern)
        identity = Identity(zone=cfg.zone, suffix=cfg.suffix, endpoint=endpoint)
        self.service = JournalService(self.registry, identity, cfg.append_timeout,
                                      cfg.min_append_rate)
        self.server = grpc.aio.server(
            interceptors=cfg.security.interceptors(JOURNAL_CAPABILITIES) or None,
            options=cfg.security.grpc_server_options(),
        )
        pb_grpc.add_JournalServicer_to_server(self.service, self.server)
        cfg.security.add_port(self.server, cfg.host, cfg.port)
        await self.server.start()
        if cfg.gateway_port:
            try:
                sock = listen(cfg.host, cfg.gateway_port)
            except OSError as err:
                await self.server.stop(None)  # (else its finalizer complains at exit)
                raise OSError(f"cannot listen on {cfg.host}:{cfg.gateway_port} for HTTP: "
                              f"{err.strerror}") from None
            self._gateway_sock = sock
            self._gateway_task = asyncio.create_task(self._gateway_when_asked(sock))
        log.info("broker serving gRPC on %s:%d, HTTP on %s, data in %s (%s)", cfg.host,
                 cfg.port, cfg.gateway_port or "(off)", cfg.data_dir,
                 cfg.security.describe())
        # Apply needs the spec models (pydantic, ~60 ms to import). They are not imported
        # before listening, which makes a (re)start that much quicker, but now, beside a
        # loop still idle, rather than on the first Apply: a starting app sends one soon.
        threading.Thread(target=importlib.import_module, args=("streamkit.protocol.spec",),
                         name="spec-import", daemon=True).start()

    async def _gateway_when_asked(self, sock: socket.socket) -> None:
        """Start the HTTP gateway on `sock` once a first client connects to it.

        aiohttp's import costs a tenth of a second of CPU, which a broker starting
        beside its consumers (`streamkit run`) would take from them; until then the
        port listens, and the first connection waits in the backlog."""
        loop = asyncio.get_running_loop()
        asked = loop.create_future()
        loop.add_reader(sock.fileno(), lambda: asked.done() or asked.set_result(None))
        try:
            await asked
        finally:  # (stopped before anyone asked: `stop` closes the socket)
            loop.remove_reader(sock.fileno())
        try:
            http = await asyncio.to_thread(importlib.import_module, "streamkit.broker.http")
            gateway = http.HttpGateway(self.registry, self.service,
                                       self.config.shutdown_grace / 3, self.config.security)
            await gateway.start(self.config.host, self.config.gateway_port, sock)
        except Exception as err:  # the gRPC service serves on without it
            log.error("the HTTP gateway failed to start: %s: %s", type(err).__name__, err)
            sock.close()
            return
        self.gateway = gateway

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT or `request_stop`, then stop gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start()
        except (OSError, RuntimeError, KeySpaceError, Exposed, TlsError) as err:
            self._release_data_dir()
            raise StartupFailed(str(err)) from err
        ticker = asyncio.create_task(self._tick())
        following = asyncio.ensure_future(self.registry.following())
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((stopping, following), return_when=asyncio.FIRST_COMPLETED)
            if following.done():  # the KeySpace was replaced: stop, then say why
                following.result()
        finally:
            following.cancel()
            stopping.cancel()
            try:
                await cancel_and_wait(ticker, "the broker's ticker")
                for task in list(self._refreshing.values()):
                    await cancel_and_wait(task, "a store listing")
            finally:  # even when the caller is cancelled meanwhile: spools must persist
                await self.stop()

    async def stop(self) -> None:
        """Refuse new RPCs, let in-flight ones finish, persist the spools, close."""
        grace = self.config.shutdown_grace
        log.info("broker stopping")
        # New calls are refused (UNAVAILABLE) from the server's stop on, so a reader whose
        # read ends below goes to the broker that comes back rather than racing the stop.
        stopping = asyncio.ensure_future(self.server.stop(grace / 3))
        await asyncio.sleep(0)
        for replica in self.registry.replicas():
            replica.end_reads()  # blocking reads would otherwise hold the servers open
        if self._gateway_task is not None:
            await cancel_and_wait(self._gateway_task, "the HTTP gateway's start")
        # Appends still waiting before the end of gRPC's grace are rolled back, UNAVAILABLE.
        rolling_back = asyncio.get_running_loop().call_later(grace / 4, self.service.stop_appends)
        try:
            await asyncio.gather(stopping,
                                 self.gateway.stop() if self.gateway else asyncio.sleep(0))
        finally:
            rolling_back.cancel()
        if self._gateway_sock is not None:
            self._gateway_sock.close()  # if no gateway took it over
        for replica in self.registry.replicas():
            await self._roll_for_shutdown(replica)
        if not await self.persister.drain(grace / 2):
            log.warning("some fragments were not persisted before shutdown; they stay spooled")
        await self.persister.stop()
        await self.registry.stop()
        self._release_data_dir()
        log.info("broker stopped")

    def _release_data_dir(self) -> None:
        if self._data_lock is not None:
            self._data_lock.release()
            self._data_lock = None

    def _local_address(self) -> str:
        """The address a client on this machine dials (named in the data dir's lock)."""
        cfg = self.config
        host = "127.0.0.1" if is_wildcard(cfg.host) else cfg.host
        scheme = "https://" if cfg.security.server_tls is not None else ""
        return f"{scheme}{host}:{cfg.port}"

    async def _roll_for_shutdown(self, replica: Replica) -> None:
        async with replica.append_lock:
            if replica.spool.length and replica.stores:
                try:
                    rolled = replica.roll()
                except OSError as err:  # a full disk: the spool is recovered at restart
                    log.warning("journal %s: could not roll its spool for persisting before "
                                "shutdown (%s); it stays spooled", replica.name, err)
                    return
                if not rolled:  # fenced (damaged from outside, say): not sealed nor persisted
                    log.warning("journal %s: its spool %s is not persisted before shutdown: "
                                "%s; it stays spooled, for the next start to recover",
                                replica.name, replica.spool.data_path, replica.spool.fenced)

    async def _tick(self) -> None:
        """Roll spools whose flush interval passed, and refresh store listings."""
        while True:
            await asyncio.sleep(TICK)
            now = time.time()
            for replica in self.registry.replicas():
                try:
                    if not replica.append_lock.locked():
                        async with replica.append_lock:
                            replica.maybe_roll(now)
                    await self._maybe_refresh(replica, now)
                    self._tick_failed.discard(replica.name)
                except Exception as err:  # one journal's trouble (a full disk) spares the rest
                    if replica.name not in self._tick_failed:  # once, not every tick
                        self._tick_failed.add(replica.name)
                        log.warning("journal %s: periodic roll/refresh failed (retrying every "
                                    "%gs): %s", replica.name, TICK, err,
                                    exc_info=not isinstance(err, OSError))

    async def _maybe_refresh(self, replica: Replica, now: float) -> None:
        interval = replica.spec.fragment.refresh_interval.ToSeconds() or 300
        if replica.known_from is not None or replica.list_soon:  # reads wait on a listing
            interval = TICK
        last = self._refreshed.setdefault(replica.name, now)
        if now - last >= interval and replica.name not in self._refreshing:
            self._refreshed[replica.name] = now
            task = asyncio.create_task(self._refresh(replica), name=f"refresh {replica.name}")
            self._refreshing[replica.name] = task
            task.add_done_callback(lambda _: self._refreshing.pop(replica.name, None))

    async def _refresh(self, replica: Replica) -> None:
        try:
            await replica.refresh()
        except Exception as err:  # (a store's failure is said by the replica)
            log.warning("journal %s: refreshing its store listing failed: %s",
                        replica.name, err, exc_info=not isinstance(err, OSError))


def keep_freed_memory(trim_threshold: int = 256 << 20) -> bool:
    """Ask glibc to reuse freed message buffers instead of returning them to the OS.

    Appends and reads churn through many 256 KiB-1 MiB buffers. By default glibc
    mmaps each and unmaps it on free, so every new buffer is fresh memory, which
    on VMs costs a page fault per 4 KiB (measured here: ~3 ms per MiB). Serving
    them from a retained heap keeps that cost out of the data path.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False  # not glibc: nothing to tune
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(
        libc.mallopt(m_trim_threshold, trim_threshold)
    )


class StartupFailed(StreamkitError):
    """The broker could not start (a port in use, an unusable data dir or KeySpace)."""


def serve(config: BrokerConfig) -> None:
    """Run a broker in this process until it is signalled to stop."""
    keep_freed_memory()
    raise_open_file_limit()  # two files per journal served
    asyncio.run(Broker(config).run())
