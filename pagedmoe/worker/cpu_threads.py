"""CPU threads for the model that survive a busy neighbour.

Every op of a step is split across the threads and waits for the slowest. With a busy process beside the
engine, one thread shares its core and the scheduler runs it in time slices of milliseconds, so every
50-microsecond op waits a slice: 2-thread decode on 2 cores was 20-60x slower next to one busy process,
while a single thread ran at about half speed. The governor measures, every `interval` seconds, how many
of this process's allowed cores other processes (or the hypervisor: steal time) used, and runs the model
on the cores left, never more than `max_threads`: a neighbour then costs about the cores it takes.
The process's one sampling thread keeps the last seconds of samples, so that an engine idle while a neighbour
ran and stopped starts its next step from the last interval, not from the idle spell's average (at one
thread: a prompt then took 1.5x as long).
Linux only (/proc); elsewhere the thread count stays at `max_threads`.
"""
import collections
import functools
import os
import threading
import time
from pathlib import Path

import torch

BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat cpu columns: user nice system irq softirq steal
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SAMPLE_SECONDS, HISTORY_SECONDS = 0.1, 5.0


def allowed_cpus() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def num_physical_cores() -> int:
    """Cores this process may run on, counting hyperthread siblings once."""
    cpus, cores = allowed_cpus(), set()
    for cpu in cpus:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(len(cores), 1)


def default_num_threads(serving: bool = False) -> int:
    """Physical cores; a server on more than 2 cores leaves one to its HTTP loop and tokenizer."""
    cores = num_physical_cores()
    return cores - 1 if serving and cores > 2 else cores


def cpu_busy_ticks() -> dict[int, int] | None:
    """Each CPU's busy clock ticks (any process, plus steal) since boot; None off Linux."""
    stat = proc_stat_cpus()
    if stat is None:
        return None
    return {int(name[3:]): sum(ticks[i] for i in BUSY_FIELDS if i < len(ticks))
            for name, ticks in stat.items() if name[3:].isdigit()}


def proc_stat_cpus() -> dict[str, list[int]] | None:
    """/proc/stat's cpu lines, name ('cpu' for all CPUs, 'cpuN' for one) -> its tick columns; None off Linux."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    return {name: [int(v) for v in values] for name, *values in map(str.split, lines) if name.startswith("cpu")}


def own_ticks() -> int | None:
    """Clock ticks this process (all its threads) ran, user + system."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


class LoadHistory:
    """Samples (time, each CPU's busy ticks, this process's ticks) every SAMPLE_SECONDS on one daemon thread
    per process, idle or not, and keeps the last HISTORY_SECONDS of them."""

    def __init__(self):
        self.samples = collections.deque([self._sample()], maxlen=int(HISTORY_SECONDS / SAMPLE_SECONDS))
        threading.Thread(target=self._run, daemon=True, name="cpu-load-sampler").start()

    @staticmethod
    def _sample() -> tuple[float, dict[int, int], int]:
        return time.monotonic(), cpu_busy_ticks(), own_ticks()

    def _run(self):
        while True:
            time.sleep(SAMPLE_SECONDS)
            self.samples.append(self._sample())

    def window(self, seconds: float) -> tuple[tuple, tuple] | None:
        """The newest sample and the newest one at least `seconds` before it; None until there is one."""
        samples = list(self.samples)
        newest = samples[-1]
        for sample in reversed(samples[:-1]):
            if newest[0] - sample[0] >= seconds:
                return sample, newest
        return None


@functools.cache
def load_history() -> LoadHistory:
    return LoadHistory()


class ThreadGovernor:
    """Call `update()` once per step: it sets torch's thread count (a setting of the calling thread) to the
    cores that other processes left free in the last `interval` seconds (at least 1, at most max_threads)."""

    def __init__(self, max_threads: int, adaptive: bool = True, interval: float = 0.5):
        self.max_threads, self.interval = max_threads, interval
        self.cpus = allowed_cpus()
        self.num_threads = max_threads
        torch.set_num_threads(max_threads)
        self.adaptive = adaptive and cpu_busy_ticks() is not None and own_ticks() is not None
        if self.adaptive:
            load_history()

    def neighbour_cores(self, last: tuple[float, int, int], now: tuple[float, int, int]) -> float:
        seconds = now[0] - last[0]
        other_ticks = (now[1] - last[1]) - (now[2] - last[2])
        return max(other_ticks, 0) / CLOCK_TICKS / seconds

    def threads_for(self, neighbour_cores: float) -> int:
        """Cores left, rounded up from three quarters of a core: a neighbour at 0.2 cores keeps every
        thread, one at 0.5 takes one away."""
        free = len(self.cpus) - neighbour_cores
        return max(1, min(self.max_threads, int(free + 0.25)))

    def advised_threads(self) -> int:
        """The threads the last interval's neighbours leave (the current count while there is no interval)."""
        window = load_history().window(self.interval) if self.adaptive else None
        if window is None:
            return self.num_threads
        last, now = ((t, sum(busy[c] for c in self.cpus), own) for t, busy, own in window)
        return self.threads_for(self.neighbour_cores(last, now))

    def update(self):
        threads = self.advised_threads()
        if threads != self.num_threads:
            torch.set_num_threads(threads)
            self.num_threads = threads
