"""The Python daemon of a local backfill: PySpark's own, started with less waiting.

Spark starts one daemon process per executor and forks a Python worker from
it for each task slot. With PySpark installed by pip, two things slow down
those first forks:

* Spark puts its bundled `pyspark.zip` first on the workers' path, and that
  archive holds sources only: every start compiles PySpark again. The very
  same PySpark is installed, byte-compiled, in site-packages.
* Each worker then imports streamkit, the stores and the clients by itself.

This daemon moves Spark's archives behind the installed packages and
imports what a backfill task uses before forking, so workers start with it
loaded; then it runs PySpark's daemon as is. `spark.py` names it as
`spark.python.daemon.module` for local masters only (where the executors'
Python is this one, and the installed PySpark is the one Spark runs).
"""

from __future__ import annotations

import sys


def _bundled(path: str) -> bool:
    """Spark's own archives of PySpark and Py4J, which it puts on the workers' path."""
    return path.endswith((".zip", ".egg")) and ("pyspark" in path or "py4j" in path)


def main() -> None:
    sys.path[:] = [p for p in sys.path if not _bundled(p)] + [p for p in sys.path if _bundled(p)]
    from pyspark.daemon import manager

    import streamkit.backfill.task  # noqa: F401  (preloaded for every forked worker)

    manager()


if __name__ == "__main__":
    main()
