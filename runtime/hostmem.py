"""Host memory: how much RAM this process can still take, and the up-front check against it.

Sources: Linux /proc/meminfo `MemAvailable` (the kernel's estimate of memory available without
swapping, reclaimable page cache included; proc(5)), os.sysconf's available pages where /proc is
absent, and the cgroup v2 limit (`memory.max` minus the part of `memory.current` that is not
reclaimable file cache, `inactive_file` of memory.stat; the kernel's cgroup-v2.rst).
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import OutOfMemoryError

CGROUP = Path("/sys/fs/cgroup")


def available_ram(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = CGROUP) -> int:
    """Bytes of RAM this process can still use: MemAvailable (else free pages from os.sysconf),
    capped by the cgroup v2 memory limit when one is set."""
    avail = _meminfo_available(meminfo)
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    headroom = _cgroup_headroom(cgroup)
    return avail if headroom is None else min(avail, headroom)


def _meminfo_available(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file counts kB
    except OSError:
        return None
    return None


def _cgroup_headroom(root: Path) -> int | None:
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int((root / "memory.current").read_text())
        stat = dict(line.split() for line in (root / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return None
    return max(0, int(limit) - used + int(stat.get("inactive_file", 0)))


def mib(n: int) -> str:
    """n bytes as MiB, e.g. '637 MiB'."""
    return f"{n / 2**20:,.0f} MiB"


def require_ram(what: str, parts: dict[str, int], available: int) -> None:
    """Raise OutOfMemoryError when the bytes in parts (name -> bytes) add up to more than
    `available`; the message names `what`, the total, each part and the available size."""
    needed = sum(parts.values())
    if needed > available:
        detail = ", ".join(f"{name} {mib(n)}" for name, n in parts.items())
        raise OutOfMemoryError(f"{what} needs {mib(needed)} of RAM ({detail}) but {mib(available)} is available; "
                               "free memory, lower --ctx-size or use a smaller model")
