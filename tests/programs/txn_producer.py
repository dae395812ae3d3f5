"""A producer process for end-to-end tests: publishes one uncommitted transaction.

    python txn_producer.py ADDRESS JOURNAL COUNT (ack|hang)

Prints "appended" once every message of the transaction is durable in the journal.
With `ack` it then waits for a line on stdin, appends the acknowledgement and prints
"acked"; with `hang` it waits to be killed before acknowledging.
"""

from __future__ import annotations

import asyncio
import sys

from streamkit.client import AppendService, BrokerClient, append_bytes, list_journals
from streamkit.message.mapping import StaticPartitions, random_mapping
from streamkit.message.publisher import Publisher


async def main(address: str, journal: str, count: int, mode: str) -> None:
    async with BrokerClient(address) as client:
        listing = await list_journals(client, f"name={journal}")
        mapping = random_mapping(StaticPartitions(listing))
        service = AppendService(client)
        publisher = Publisher(service)
        for i in range(count):
            await publisher.publish_uncommitted(mapping, {"txn": mode, "i": i})
        await service.flush()
        print("appended", flush=True)
        if mode == "hang":
            await asyncio.sleep(3600)
        await asyncio.to_thread(sys.stdin.readline)  # the test's go-ahead
        for intent in publisher.build_ack_intents():
            await append_bytes(client, intent.journal, intent.content)
        print("acked", flush=True)
        await service.close()


if __name__ == "__main__":
    address, journal, count, mode = sys.argv[1:]
    asyncio.run(main(address, journal, int(count), mode))
