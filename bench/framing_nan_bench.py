"""What the NaN check costs a published dict: JsonLinesFraming.frame_dict against orjson.

    python bench/framing_nan_bench.py

orjson writes NaN and infinities as `null`; frame_dict searches each frame for `null`
and, only where it finds one, the message for the float that became it. Printed: ns per
message for a small dict without and with a `None` field, each way (best of 7).
"""

from __future__ import annotations

import functools
import timeit

import orjson

from streamkit.message.framings.json_lines import JsonLinesFraming

MESSAGES = {
    "small": {"key": "user-1234", "n": 17, "ts": 1732700000.123, "word": "hello"},
    "with None": {"key": "user-1234", "n": 17, "ts": None, "word": "hello"},
}
WAYS = {
    "orjson alone": functools.partial(orjson.dumps, option=orjson.OPT_APPEND_NEWLINE),
    "frame_dict": JsonLinesFraming.frame_dict,
}


def main() -> None:
    for name, message in MESSAGES.items():
        for label, frame in WAYS.items():
            runs = timeit.repeat("frame(m)", globals={"frame": frame, "m": message},
                                 number=300_000, repeat=7)
            print(f"{name:10} {label:13} {min(runs) / 300_000 * 1e9:6.0f} ns")


if __name__ == "__main__":
    main()
