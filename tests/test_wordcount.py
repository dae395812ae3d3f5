"""examples/wordcount through streamkit.testing: exact counts with each store kind."""

from __future__ import annotations

import random
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from streamkit.testing import AppHarness
from tests.e2e import totals_of_updates

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "wordcount"


def generate_lines(n: int, vocabulary: int = 200, seed: int = 7) -> list[str]:
    """Lines of 3-7 words from a small vocabulary (so words repeat across shards)."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(vocabulary)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 7))) for _ in range(n)]


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "wordcount"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns(".streamkit", "__pycache__"))
    return folder


def with_sql_url(app_dir: Path, url: str) -> None:
    config = app_dir / "streamkit.yaml"
    text = config.read_text().replace("  kind: rocksdb", f"  kind: sql\n  url: {url}")
    config.write_text(text)


@pytest.mark.parametrize("store", ["rocksdb", "sqlite", "json", "sql", "sql-on-sqlite"])
async def test_wordcount_counts_exactly(app_dir: Path, store: str, request: Any) -> None:
    kind: str | None = store
    if store == "sql":
        with_sql_url(app_dir, request.getfixturevalue("postgres_url"))
        kind = None  # streamkit.yaml names it, with the url
    elif store == "sql-on-sqlite":
        kind = "sql"  # no url: an SQLite file of the harness
    lines = generate_lines(2000)
    expected = Counter(word for line in lines for word in line.split())
    async with AppHarness(app_dir, store=kind) as h:
        assert len(h.replicas) == 8
        await h.publish("wordcount/lines", ({"id": i, "line": line}
                                            for i, line in enumerate(lines[:1200])))
        await h.wait_idle()
        await h.publish("wordcount/lines", ({"id": i, "line": line}
                                            for i, line in enumerate(lines[1200:], 1200)))
        await h.wait_idle()
        for word in ("w0", "w17", "w199", "absent"):
            answers = {shard: await h.query({"word": word}, shard=shard) for shard in h.replicas}
            assert h.app("shard-000").combine_answers(answers) == expected[word]
        assert totals_of_updates(await h.read_output("wordcount/counts")) == expected
