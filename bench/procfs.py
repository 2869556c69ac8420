"""What the benchmarks read of a Linux process from /proc: memory (MiB) and CPU time (s)."""

from __future__ import annotations

import os
from pathlib import Path

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def field_mib(path: str, name: str) -> int | None:
    """A `Name:  N kB` line of a /proc file, in MiB; None if the process (or the line) is gone."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(name + ":"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError):
        return None
    return None


def rss_mib() -> float:
    """This process's resident set (float, with the kB precision of /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return float("nan")


def cpu_seconds(pid: int | str = "self") -> float:
    """User plus system CPU time a process has used so far, in seconds (nan if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (OSError, ValueError, IndexError):
        return float("nan")


def thread_cpu_seconds(pid: int | str = "self") -> tuple[float, float]:
    """(its main thread's, all its threads') CPU time so far, in seconds, from the scheduler's
    nanosecond counts (nan if the process is gone). The rest of a gRPC process's threads are gRPC's
    own (its event engine and the asyncio poller); Python runs in the main thread."""
    pid = os.getpid() if pid == "self" else int(pid)
    main = total = 0.0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                used = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):  # (a thread that ended just now)
                continue
            total += used
            if int(tid) == pid:
                main = used
    except OSError:
        return float("nan"), float("nan")
    return main, total
