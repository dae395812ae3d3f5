"""Recovery-log playback throughput: MB/s of log played back into a directory.

Run: python bench/recoverylog_bench.py [--mib 256] [--write-kib 1024] [--json out.json]

Starts a fresh broker (its own temp data dir), records `--mib` MiB of large
writes spread over a few files through RecordedFS (RocksDB-like: files written
once, sequentially), then times a Player rebuilding the directory from the
recorder's hints (finishing at the write head), and from empty hints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


from bench.common import MIB, create_log, machine, with_broker  # noqa: E402
from streamkit.client import BrokerClient  # noqa: E402
from streamkit.recoverylog import (  # noqa: E402
    FSM,
    Player,
    RecordedFS,
    Recorder,
    rpb,
)


async def record(client: BrokerClient, log: str, root: Path, mib: int, write_kib: int
                 ) -> tuple[rpb.FSMHints, float]:
    recorder = Recorder(client, log, FSM(rpb.FSMHints(log=log)))
    await recorder.start()
    fs = RecordedFS(root, recorder)
    root.mkdir(parents=True)
    block = os.urandom(write_kib << 10)
    per_file = max(1, 64 * MIB // len(block))
    started = time.perf_counter()
    writes = mib * MIB // len(block)
    f = None
    for i in range(writes):
        if i % per_file == 0:
            if f is not None:
                f.close()
            f = fs.open(f"{i // per_file:06d}.sst", "wb")
        f.write(block)
        if i % 8 == 7:
            await fs.fsync()
    if f is not None:
        f.close()
    hints = await recorder.build_hints()
    elapsed = time.perf_counter() - started
    await recorder.close()
    return hints, mib / elapsed


async def play(client: BrokerClient, hints: rpb.FSMHints, out: Path) -> tuple[float, int]:
    player = Player(client)
    player.finish_at_write_head()
    started = time.perf_counter()
    await player.play(hints, out)
    elapsed = time.perf_counter() - started
    read = sum(end - begin for _, begin, end in player.fetched)
    return read / MIB / elapsed, read


async def run(address: str, args: argparse.Namespace, tmp: Path) -> dict[str, float | str]:
    async with BrokerClient(address) as client:
        log = "bench/recoverylog"
        await create_log(client, log)
        hints, record_mb_s = await record(client, log, tmp / "live", args.mib, args.write_kib)
        results: dict[str, float | str] = {"record_mb_s": record_mb_s}
        for label, h in (("hinted", hints), ("unhinted", rpb.FSMHints(log=log))):
            best = 0.0
            for attempt in range(args.repeat):
                mb_s, _ = await play(client, h, tmp / f"out-{label}-{attempt}")
                best = max(best, mb_s)
            results[f"playback_{label}_mb_s"] = best
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB of file data to record")
    parser.add_argument("--write-kib", type=int, default=1024, help="KiB per recorded write")
    parser.add_argument("--repeat", type=int, default=3, help="playbacks per case (best kept)")
    parser.add_argument("--json", type=Path, help="also write results here")
    args = parser.parse_args()
    results = with_broker(lambda broker, tmp: run(broker.address, args, tmp))
    results["machine"] = machine()
    results["mib"] = str(args.mib)
    for key, value in results.items():
        print(f"{key:28} {value:>10.1f}" if isinstance(value, float) else f"{key:28} {value}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
