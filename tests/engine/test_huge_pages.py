"""The huge-page arena the q4q8 weights are streamed from (core/engine/model/huge_pages.py)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from loopstack.engine.model import huge_pages, quant

pytestmark = pytest.mark.skipif(not huge_pages.huge_pages_enabled(), reason="no MADV_HUGEPAGE here (not Linux)")


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def _vmstat(name: str) -> int:
    with open("/proc/vmstat") as f:
        return next((int(line.split()[1]) for line in f if line.startswith(name + " ")), 0)


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unknown"
    return text.split("[")[1].split("]")[0]


def test_copies_are_equal_aligned_and_side_by_side() -> None:
    tensors = [torch.randint(0, 255, (3 << 20,), dtype=torch.uint8), torch.randn(1000).half(),
               torch.randn(7, 33), torch.arange(5, dtype=torch.int64)]
    copies = huge_pages.huge_page_copies(tensors)
    assert [c.dtype for c in copies] == [t.dtype for t in tensors]
    assert all(torch.equal(c, t) and c.shape == t.shape for c, t in zip(copies, tensors))
    assert copies[0].data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert all(c.data_ptr() % 64 == 0 for c in copies)
    # one arena: each copy right after the one before (cache-line padded)
    for before, after in zip(copies, copies[1:]):
        end = before.data_ptr() + before.numel() * before.element_size()
        assert 0 <= after.data_ptr() - end < 64
    copies[2].add_(1)  # copies, not views of the originals
    assert not torch.equal(copies[2], tensors[2])


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off on this kernel")
def test_the_arena_gets_huge_pages() -> None:
    before, fallbacks = _anon_huge_kib(), _vmstat("thp_fault_fallback")
    copies = huge_pages.huge_page_copies([torch.ones(16 << 20, dtype=torch.uint8)])
    if _vmstat("thp_fault_fallback") > fallbacks:
        pytest.skip("the kernel had no free 2 MiB pages just now (thp_fault_fallback grew)")
    assert _anon_huge_kib() - before >= 8 << 10  # most of the 16 MiB in 2 MiB pages
    assert copies[0].sum().item() == 16 << 20


def test_the_arena_outlives_everything_but_its_tensors() -> None:
    copy = huge_pages.huge_page_copies([torch.full((4 << 20,), 3, dtype=torch.uint8)])[0]
    gc.collect()  # nothing but the tensor holds the mapping
    view = copy[10:20]
    del copy
    gc.collect()
    assert view.tolist() == [3] * 10


def test_small_or_switched_off_stays_ordinary(monkeypatch: pytest.MonkeyPatch) -> None:
    small = [torch.randn(10)]
    assert huge_pages.huge_page_copies(small)[0] is small[0]
    assert huge_pages.huge_page_zeros((4,), torch.float32).tolist() == [0.0] * 4
    monkeypatch.setenv("LOOPSTACK_HUGE_PAGES", "0")
    big = [torch.zeros(3 << 20, dtype=torch.uint8)]
    assert huge_pages.huge_page_copies(big)[0] is big[0]


def test_zeros_are_zero_in_any_dtype() -> None:
    zeros = huge_pages.huge_page_zeros((2, 3, 1 << 18), torch.float16)
    assert zeros.shape == (2, 3, 1 << 18) and zeros.dtype == torch.float16
    assert zeros.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0 and not zeros.any()


@pytest.mark.skipif(not quant.extension.has_q4q8(), reason="the q4q8 kernel needs AVX-512 VNNI or AVX2, and the C++ extension")
def test_a_quantized_model_streams_from_the_arena_and_computes_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))  # 1 MiB of codes each
    x = torch.randn(3, 1024)
    monkeypatch.setenv("LOOPSTACK_HUGE_PAGES", "0")
    reference = copy.deepcopy(model)
    assert quant.quantize_model(reference, "int4", int4_kernel="q4q8") == 2
    monkeypatch.delenv("LOOPSTACK_HUGE_PAGES")
    moved = copy.deepcopy(model)
    quant.quantize_model(moved, "int4", int4_kernel="q4q8")
    first, second = (m for m in moved.modules() if isinstance(m, quant.Int4Linear))
    assert first.packed.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0  # the arena's start
    assert first.packed.data_ptr() < first.scales_and_zeros.data_ptr() < second.packed.data_ptr()
    assert second.packed.data_ptr() - first.packed.data_ptr() < 2 * first.packed.numel() + (1 << 20)
    with torch.inference_mode():
        assert torch.equal(moved(x), reference(x))  # the same codes, the same kernel: the same bits


def test_a_refused_mapping_leaves_ordinary_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    big = [torch.ones(3 << 20, dtype=torch.uint8)]
    assert huge_pages.huge_page_copies(big)[0] is big[0]  # the engine still loads
    zeros = huge_pages.huge_page_zeros((3 << 20,), torch.uint8)
    assert zeros.shape == (3 << 20,) and not zeros.any()
