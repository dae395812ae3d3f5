"""AppendBuffer: what is read back equals what was written and kept, in memory or spilled."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from streamkit.client.append_buffer import AppendBuffer

_ops = st.lists(
    st.one_of(
        st.binary(max_size=300).map(lambda data: ("write", data)),
        st.integers(min_value=0, max_value=2000).map(lambda size: ("truncate", size)),
    ),
    max_size=40,
)


@given(_ops, st.integers(min_value=1, max_value=700), st.integers(min_value=1, max_value=97))
def test_buffer_reads_back_what_was_kept(ops: list, spill_at: int, chunk_size: int) -> None:
    buffer, expected = AppendBuffer(spill_at=spill_at), bytearray()
    for op, arg in ops:
        if op == "write":
            buffer.write(arg)
            expected += arg
        else:
            size = min(arg, len(expected))
            buffer.truncate(size)
            del expected[size:]
        assert buffer.size == len(expected)
    chunks = list(buffer.chunks(chunk_size))
    assert all(len(c) == chunk_size for c in chunks[:-1])
    assert b"".join(chunks) == expected
    assert b"".join(buffer.chunks(chunk_size)) == expected  # again, as a retry reads it
    buffer.close()
    assert buffer.size == 0 and not buffer.spilled


def test_buffer_spills_past_its_limit_and_keeps_writing_to_the_file() -> None:
    buffer = AppendBuffer(spill_at=10)
    buffer.write(b"0123456789")
    assert not buffer.spilled
    buffer.write(b"a")
    assert buffer.spilled
    buffer.write(b"bc")
    buffer.truncate(12)
    assert b"".join(buffer.chunks(5)) == b"0123456789ab"
    buffer.close()
