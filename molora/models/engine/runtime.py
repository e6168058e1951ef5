"""Process-wide runtime settings shared by the app, the Python API and the CLI: the CPU thread count (and the CPUs a
process may use, which the C decode step splits its rows over: `available_cpus`).

Decode steps of the embedded model are small (a 256-wide, 6-layer LM, batch 1-2): splitting each matmul over cores costs
more in synchronisation than it saves, and when another process busy-waits on one of the cores every step waits
for the slower thread. So torch gets one intra-op thread by default. Override it with MOLORA_THREADS=<n>, the CLI's and
the app's --threads, or `configure_cpu_threads(n)` before loading a model (0 = leave torch's own). A choice made
with OMP_NUM_THREADS or torch.set_num_threads is left alone.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from molora.routing.errors import MoLoRAError

log = logging.getLogger(__name__)

THREADS_ENV = "MOLORA_THREADS"
# C1 workload (benchmarks/cpu_speed.py: one image + 83 text tokens, embedded model), 2-core VM shared with other
# developers' jobs (load average 3-6), medians (benchmarks/RESULTS.md, "CPU threads"): quiet-ish 2.16 / 2.32 s with
# 1 thread vs 2.20 s and once 19.95 s with 2; alternated in one process 5.27 vs 6.44 s; with a spinning process
# 10.41 vs 9.56 s and, in separate runs, 9.69 / 8.96 s vs 4.70 / 10.71 s. One thread was at worst 2.1x slower than
# two, two threads 8.6x slower than one (and the issue saw 96-116 s vs ~3 s): the default is 1.
DEFAULT_CPU_THREADS = 1


_chosen: int | None = None  # an explicit choice made earlier in this process (CLI / app flag) wins over the default
_TORCH_AT_IMPORT = torch.get_num_threads()  # differs later only if someone called torch.set_num_threads


def cpu_threads(requested: int | None = None) -> int:
    """The thread count to use (0 = leave torch's): `requested`, else an explicit choice made earlier in this
    process, else $MOLORA_THREADS, else 0 when the user already chose (OMP_NUM_THREADS, or torch.set_num_threads
    after importing models), else DEFAULT_CPU_THREADS."""
    if requested is None and _chosen is not None:
        return _chosen
    if requested is None:
        raw = os.environ.get(THREADS_ENV, "").strip()
        if not raw:
            user_chose = bool(os.environ.get("OMP_NUM_THREADS")) or torch.get_num_threads() != _TORCH_AT_IMPORT
            return 0 if user_chose else DEFAULT_CPU_THREADS
        if not raw.isdigit():
            raise MoLoRAError(f"{THREADS_ENV}={raw!r} is not a whole number >= 0; set it to the CPU threads torch "
                              "should use (e.g. 1), or 0 to leave torch's default")
        return int(raw)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise MoLoRAError(f"CPU threads must be a whole number >= 0 (0 = leave torch's default), got {requested!r}")
    return requested


def configure_cpu_threads(requested: int | None = None) -> int:
    """Set torch's intra-op thread count by `cpu_threads` and return what torch now uses. An explicit `requested`
    is remembered, so loading a model afterwards (which calls this with None) keeps it."""
    global _chosen
    threads = cpu_threads(requested)
    if requested is not None:
        _chosen = threads
    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        log.debug("torch uses %d CPU thread(s)", threads)
    return torch.get_num_threads()


# cgroup v2's CPU limit ("<quota> <period>" or "max <period>") and v1's quota and period, in microseconds
CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"
CGROUP_V1_QUOTA = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask (where the OS has one), within its container's CPU quota (a
    container may see every CPU of its host and be allowed two: more busy threads than the quota get throttled)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # (no affinity masks on this OS)
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cpus, -(-quota[0] // quota[1]))) if quota else cpus


def _cgroup_quota() -> tuple[int, int] | None:
    """(quota, period) of this process's cgroup CPU limit, None when there is none or it cannot be read."""
    try:
        fields = Path(CGROUP_CPU_MAX).read_text().split()
    except OSError:
        try:
            fields = [Path(path).read_text().strip() for path in CGROUP_V1_QUOTA]
        except OSError:
            return None
    try:
        quota, period = int(fields[0]), int(fields[1])
    except (ValueError, IndexError):  # "max": no limit
        return None
    return (quota, period) if quota > 0 and period > 0 else None


def available_memory(device: str | torch.device) -> int | None:
    """Bytes that can still be allocated on `device` (free GPU memory; the CPU's MemAvailable), None if unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def device_name(device: str | torch.device) -> str:
    """What a results file records as the device: the GPU's name, or "cpu"."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


__all__ = ["DEFAULT_CPU_THREADS", "THREADS_ENV", "available_cpus", "available_memory", "configure_cpu_threads",
           "cpu_threads", "device_name"]
