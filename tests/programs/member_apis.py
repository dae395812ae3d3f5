"""A member process for tests: serves one member's APIs (running no shards) until stdin closes.

    python member_apis.py CONFIG_JSON KEYSPACE WORK_DIR BROKER [PORT]

CONFIG_JSON is a streamkit.yaml document as JSON. Prints "ready" once set up,
then starts the APIs when it reads a line (so that several processes can be
started at the same moment), and prints the member's gRPC port (HTTP is on
the next) once both servers are up, or "OSError: ..." and exits 1 when they
can't listen.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from streamkit.app.application import Application
from streamkit.app.config import AppConfig
from streamkit.app.member import Member, MemberOptions
from streamkit.app.member_apis import serve_member_apis
from streamkit.client import BrokerClient
from streamkit.keyspace import open_keyspace


class Idle(Application):
    """Never runs: the member serves its APIs without starting."""


async def main(document: str, keyspace_path: str, work_dir: str, broker: str, port: int) -> int:
    config = AppConfig.parse(json.loads(document), app_dir=Path(work_dir))
    async with BrokerClient(broker) as client, open_keyspace(keyspace_path) as keyspace:
        options = MemberOptions(work_dir=Path(work_dir), allocate=False, suffix=Path(work_dir).name)
        member = Member(config, Idle, client, keyspace, options)
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        try:
            apis = await serve_member_apis(member, port=port)
        except OSError as err:
            print(f"OSError: {err}", flush=True)
            return 1
        print(apis.port, flush=True)
        try:
            await asyncio.to_thread(sys.stdin.read)  # until the test closes our stdin
        finally:
            await apis.stop(None)
    return 0


if __name__ == "__main__":
    document, keyspace_path, work_dir, broker, *rest = sys.argv[1:]
    port = int(rest[0]) if rest else 0
    sys.exit(asyncio.run(main(document, keyspace_path, work_dir, broker, port)))
