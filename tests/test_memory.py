import gc
import sys
import weakref

import pytest
import torch

import resource

from pagedmoe.memory import HUGE_PAGE, empty_huge, freeze_startup_heap, huge_copy, keep_freed_memory, zeros_huge
from pagedmoe.worker.kv_cache import KVCacheStorage


def test_small_tensors_are_plain():
    t = empty_huge((4, 5), torch.float32)
    assert t.shape == (4, 5) and t.dtype == torch.float32 and t.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_tensors_are_huge_page_aligned_and_usable(dtype):
    shape = (3, HUGE_PAGE // 1024, 300)
    t = zeros_huge(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.abs().sum().item() == 0
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % HUGE_PAGE == 0
    t[1, 2, 3] = 5
    assert t.sum().item() == 5


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and anonymous mappings")
def test_large_zeros_become_resident_only_where_touched():
    before = resident_bytes()
    t = zeros_huge((64, 1 << 20), torch.float32)  # 256 MiB
    assert resident_bytes() - before < 16 << 20
    t[5].fill_(1.0)
    assert resident_bytes() - before < 32 << 20
    assert t[4:7].sum().item() == 1 << 20 and t[60].abs().sum().item() == 0


def page_faults_of_a_fresh_64mb_tensor() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.ones(16 << 20)
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_freed_memory_is_reused_without_page_faults():
    assert keep_freed_memory()
    page_faults_of_a_fresh_64mb_tensor()
    # Unmapped on free, every 64 MB tensor would fault all of its pages in again. Kept, most reuse the freed
    # block; a small allocation can take its front now and then, and the next few land past it
    faults = [page_faults_of_a_fresh_64mb_tensor() for _ in range(12)]
    assert sum(count < 1638 for count in faults) >= 6, faults


def test_the_startup_heap_is_collected_then_frozen():
    class Node:
        pass
    cycle = Node()
    cycle.self = cycle
    garbage = weakref.ref(cycle)
    del cycle  # unreachable: freed by the collection, not frozen with the rest
    try:
        freeze_startup_heap()
        assert garbage() is None and gc.get_freeze_count() > 0 and gc.get_count()[2] == 0
    finally:
        gc.unfreeze()


def test_huge_copy_is_an_equal_contiguous_copy_on_huge_pages():
    source = torch.randn(HUGE_PAGE // 256, 300).t()  # a strided view
    copy = huge_copy(source)
    assert copy.is_contiguous() and torch.equal(copy, source) and copy.data_ptr() != source.data_ptr()
    if sys.platform.startswith("linux"):
        assert copy.data_ptr() % HUGE_PAGE == 0


def small_kv_pool(num_blocks: int) -> KVCacheStorage:  # 64 KiB a block: 2 layers, K and V, 4 heads of 64
    return KVCacheStorage(2, 2, (4, 64), num_blocks, 1, 16, torch.float32, torch.device("cpu"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and anonymous mappings")
def test_prefault_makes_the_first_blocks_resident_and_leaves_them_zero():
    pool = small_kv_pool(1024)  # 64 MiB, lazily zeroed
    before = resident_bytes()
    assert pool.prefault(0) == 0 and resident_bytes() - before < 4 << 20
    assert pool.prefault(16 << 20) == 256
    assert resident_bytes() - before >= 15 << 20
    assert pool.device_cache[:, :, :256].abs().sum().item() == 0


def test_prefault_stops_at_the_pool_size_and_takes_all_of_it_by_default():
    assert small_kv_pool(8).prefault(1 << 30) == 8
    assert small_kv_pool(24).prefault() == 24
