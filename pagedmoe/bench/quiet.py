"""Waiting for the host's CPUs to go quiet before an engine's turn in an interleaved bench. vLLM's CPU engine
keeps a core busy for about a second after its last request (measured on Zen 1 with `vllm serve`: one process
at a full core for 1.0-1.25 s); without the wait, that second lands on the engine that runs next."""
import os
import time

from pagedmoe.worker.cpu_threads import proc_stat_cpus


def cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat; None where there is no /proc/stat.
    Busy is user, nice, system, irq and softirq: neither idle, iowait nor steal (other tenants' time)."""
    stat = proc_stat_cpus()
    if stat is None or len(stat.get("cpu", ())) < 8:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = stat["cpu"][:8]
    busy = user + nice + system + irq + softirq
    return busy, busy + idle + iowait + steal


def wait_for_quiet_cpus(timeout_s: float, max_busy_cores: float = 0.2, quiet_s: float = 1.0, window_s: float = 0.25,
                        ticks=cpu_ticks, num_cpus: int | None = None) -> float:
    """Blocks until the CPUs were at most `max_busy_cores` cores busy in all for `quiet_s` in a row, or
    `timeout_s` passed; returns the seconds it waited. 0.2 cores: pagedmoe's thread governor
    (worker/cpu_threads.py) takes a thread away from a neighbour at 0.25 cores on, and a quarter of 2 CPUs
    (this bound before) let a first request after vLLM's start-up run on one thread."""
    num_cpus = num_cpus or os.cpu_count() or 1
    start, num_quiet, last = time.monotonic(), 0, ticks()
    while last is not None and num_quiet * window_s < quiet_s and time.monotonic() - start < timeout_s:
        time.sleep(window_s)
        now = ticks()
        busy_cores = (now[0] - last[0]) / max(now[1] - last[1], 1) * num_cpus
        num_quiet, last = num_quiet + 1 if busy_cores <= max_busy_cores else 0, now
    return time.monotonic() - start
