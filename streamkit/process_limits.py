"""The process's open-file limit, raised to what the system allows before serving.

A broker holds two files open for each journal it serves (its spool's data and its
commits), and a member a store's files per shard; the usual soft limit of 1024 runs
out at a few hundred journals ("Too many open files"), while the hard limit is most
often far higher. Go programs (Gazette's broker among them) raise the soft limit to
the hard one at start; servers of streamkit do the same.
"""

from __future__ import annotations

import resource

__all__ = ["raise_open_file_limit"]


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (OSError, ValueError):  # a limit the kernel caps lower: keep what we have
            pass
    return soft
