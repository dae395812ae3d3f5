"""A feeder process for the end-to-end tests: publishes wordcount lines, committed.

    python wordcount_feeder.py ADDRESS APP_DIR [--start N] [--count N] [--batch N]
                               [--interval SECONDS] --report FILE
                               [--auth-keys KEYS] [--tls-ca FILE]

Line `id` is `tests.e2e.line_of(id)`, routed as the app's streamkit.yaml routes
its source topic. Lines go out in batches; after each batch is acknowledged
the total so far is appended to the report file (a line per batch), so a
test knows exactly which ids are durable. It runs until `--count` lines are
out (0: until SIGTERM, which ends it after the batch in flight). With
`--auth-keys` it signs its appends, and `--tls-ca` trusts that CA for an
`https://` ADDRESS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from pathlib import Path

from streamkit.app.config import load_config
from streamkit.auth import ClientTls, Security, parse_keys
from streamkit.client import AppendService, BrokerClient
from streamkit.message.publisher import Publisher
from tests.e2e import SOURCE, line_of


async def main(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    mapping = load_config(args.app_dir).mapping_for(SOURCE)
    report = Path(args.report)
    sent = 0
    security = Security(keys=parse_keys(args.auth_keys) if args.auth_keys else None,
                        client_tls=ClientTls(ca=Path(args.tls_ca)) if args.tls_ca else None)
    async with BrokerClient(args.address, security) as client, \
            AppendService(client) as service:
        publisher = Publisher(service)
        while not stop.is_set() and (args.count == 0 or sent < args.count):
            n = args.batch if args.count == 0 else min(args.batch, args.count - sent)
            for i in range(args.start + sent, args.start + sent + n):
                await publisher.publish_committed(mapping, {"id": i, "line": line_of(i)})
            await service.flush()
            sent += n
            with report.open("a") as out:
                out.write(f"{sent}\n")
            if args.interval:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), args.interval)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("app_dir")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--count", type=int, default=0)
    parser.add_argument("--batch", type=int, default=40)
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--report", required=True)
    parser.add_argument("--auth-keys", default=None)
    parser.add_argument("--tls-ca", default=None)
    asyncio.run(main(parser.parse_args()))
