import subprocess
import sys
import threading
import time

import pytest
import torch

from pagedmoe.worker import cpu_threads
from pagedmoe.worker.cpu_threads import ThreadGovernor, cpu_busy_ticks, default_num_threads, num_physical_cores

BUSY = "import time, sys\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end: pass"
linux_only = pytest.mark.skipif(cpu_busy_ticks() is None, reason="needs Linux /proc/stat")


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_follow_the_cores_neighbours_leave(monkeypatch):
    monkeypatch.setattr(cpu_threads, "allowed_cpus", lambda: {0, 1, 2, 3})
    governor = ThreadGovernor(4, adaptive=False)
    assert [governor.threads_for(n) for n in (0.0, 0.2, 0.5, 1.0, 1.7, 3.0, 4.0)] == [4, 4, 3, 3, 2, 1, 1]
    assert ThreadGovernor(2, adaptive=False).threads_for(0.0) == 2


def test_neighbour_cores_subtract_our_own_ticks():
    governor = ThreadGovernor(1, adaptive=False)
    ticks = cpu_threads.CLOCK_TICKS
    assert governor.neighbour_cores((0.0, 0, 0), (2.0, 3 * ticks, ticks)) == pytest.approx(1.0)
    assert governor.neighbour_cores((0.0, 0, 0), (1.0, ticks, 2 * ticks)) == 0.0


def test_serving_reserves_a_core_only_above_two(monkeypatch):
    for cores, alone, serving in ((1, 1, 1), (2, 2, 2), (8, 8, 7)):
        monkeypatch.setattr(cpu_threads, "num_physical_cores", lambda: cores)
        assert (default_num_threads(), default_num_threads(serving=True)) == (alone, serving)
    assert 1 <= num_physical_cores() <= len(cpu_threads.allowed_cpus())


@linux_only
def test_busy_neighbours_take_threads_away():
    """As many busy processes as allowed cores: the governor drops to one thread within a few intervals."""
    num_cpus = len(cpu_threads.allowed_cpus())
    governor = ThreadGovernor(num_cpus, interval=0.2)
    neighbours = [subprocess.Popen([sys.executable, "-c", BUSY, "20"]) for _ in range(num_cpus)]
    try:
        deadline = time.monotonic() + 15
        while governor.num_threads > 1 and time.monotonic() < deadline:
            time.sleep(0.25)
            governor.update()
    finally:
        for process in neighbours:
            process.kill()
            process.wait()
    assert governor.num_threads == 1 == torch.get_num_threads()


def test_not_adaptive_keeps_max_threads():
    governor = ThreadGovernor(2, adaptive=False, interval=0.0)
    governor.update()
    assert governor.num_threads == 2 == torch.get_num_threads()


@linux_only
@pytest.mark.skipif(len(cpu_threads.allowed_cpus()) < 2, reason="one core: one thread whatever the neighbours")
def test_a_neighbour_gone_while_idle_leaves_every_thread():
    """The first step after an idle spell runs on the load of the last interval, not on the average since the
    step before (which would count neighbours that have stopped)."""
    num_cpus = len(cpu_threads.allowed_cpus())
    governor = ThreadGovernor(num_cpus, interval=0.2)
    neighbours = [subprocess.Popen([sys.executable, "-c", BUSY, "20"]) for _ in range(num_cpus)]
    try:
        time.sleep(1.5)
        noticed = governor.advised_threads()
    finally:
        for process in neighbours:
            process.kill()
            process.wait()
    time.sleep(0.7)
    governor.update()
    assert noticed == 1 and governor.num_threads == num_cpus == torch.get_num_threads()


def test_one_sampling_thread_serves_every_governor():
    governors = [ThreadGovernor(2, interval=0.05) for _ in range(3)]
    samplers = [t for t in threading.enumerate() if t.name == "cpu-load-sampler"]
    assert len(samplers) == (1 if governors[0].adaptive else 0)
