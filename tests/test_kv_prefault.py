"""``--kv-cache-prefault``: every page of the KV pool is resident after start, nothing in it
changes, and the engine's outputs are those of a lazily mapped pool. And pool tensors of a huge
page or more sit on huge-page boundaries with the kernel's huge-page advice.

Residency is read from the kernel (``mincore``), not from the engine: a pool that was only
allocated has almost no resident pages (calloc maps zero pages on demand), a prefaulted one
has all of them.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from kvserve.config import CacheConfig, ConfigError
from kvserve.kv.formats import make_kv_storage
from kvserve.kv.storage import HUGE_PAGE_BYTES, PAGE_BYTES, zeros

PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL("libc.so.6", use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_DONTNEED = 4


def resident_fraction(t: torch.Tensor) -> float:
    """Share of the pages under ``t`` that are resident, as the kernel reports it."""
    start = t.data_ptr() // PAGE * PAGE
    end = t.data_ptr() + t.numel() * t.element_size()
    n = (end - start + PAGE - 1) // PAGE
    vec = ctypes.create_string_buffer(n)
    if _libc.mincore(start, end - start, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec.raw) / n


def unmap(t: torch.Tensor) -> None:
    """Give the whole pages under a fresh (all-zero) tensor back to the kernel, as a fresh
    mapping is, whichever way the allocator served it (a recycled heap chunk is resident);
    reading them again gives zeros, so the tensor is unchanged."""
    start = (t.data_ptr() + PAGE - 1) // PAGE * PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // PAGE * PAGE
    if end > start and _libc.madvise(start, end - start, MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise")


def pool_tensors(storage):  # noqa: ANN001, ANN201 - a KVStorage
    return [t for ts in storage.distinct_block_tensors().values() for t in ts]


def vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise LookupError(f"no mapping holds {address:#x}")


def test_large_pool_tensors_are_huge_page_aligned_advised_and_lazy():
    shape = (600, 4, 16, 64)  # 4.7 MiB of bf16
    t = zeros(shape, torch.bfloat16, torch.device("cpu"))
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert "hg" in vm_flags(t.data_ptr())  # MADV_HUGEPAGE, as the kernel records it
    assert resident_fraction(t) < 0.01  # nothing taken before the first write
    t[300] = 1.5
    assert t.sum().item() == 1.5 * 4 * 16 * 64 and not t[:300].any() and not t[301:].any()
    small = zeros((3, 4, 16, 64), torch.bfloat16, torch.device("cpu"))
    assert small.shape == (3, 4, 16, 64) and not small.any()


def test_page_stride_is_the_system_page_or_a_divisor_of_it():
    # One byte every PAGE_BYTES reaches every page when the stride divides the page size.
    assert PAGE % PAGE_BYTES == 0


@pytest.mark.parametrize("fmt", ["bfloat16", "fp8_e4m3", "int8", "kivi4"])
def test_prefault_makes_every_page_resident_and_keeps_contents(fmt):
    blocks = {"bfloat16": 3072, "fp8_e4m3": 6144, "int8": 6144, "kivi4": 12288}[fmt]
    storage = make_kv_storage(fmt, 2, blocks, 16, 8, 64, torch.bfloat16)
    tensors = pool_tensors(storage)
    big = [t for t in tensors if t.numel() * t.element_size() >= 40 << 20]
    for t in big:
        unmap(t)
    assert max(resident_fraction(t) for t in big) < 0.01  # as a lazily mapped pool starts
    # Some blocks hold data (written as a request would, through the format's own write).
    k = torch.randn(40, 8, 64, dtype=torch.bfloat16)
    v = torch.randn(40, 8, 64, dtype=torch.bfloat16)
    slots = torch.arange(100 * 16, 100 * 16 + 40)
    storage.begin_step(slots)
    for layer in range(2):
        storage.write(layer, slots, k, v)
    # The reference is read from the written blocks and the fixed tensors only: a read maps
    # the kernel's zero page, which mincore counts as resident, so the rest is left unread.
    written = [t[100:103].clone() for t in tensors]
    fixed = [t.clone() for t in storage.fixed_tensors()]

    touched = storage.prefault()

    assert min(resident_fraction(t) for t in big) == 1.0
    for t, w in zip(tensors, written, strict=True):
        assert torch.equal(t[100:103], w)
        assert not t[:100].any() and not t[103:].any()
    assert all(torch.equal(a, b) for a, b in zip(storage.fixed_tensors(), fixed, strict=True))
    everything = tensors + storage.fixed_tensors()
    assert touched == sum(t.numel() * t.element_size() for t in everything)


def test_engine_with_prefault_answers_as_one_without(make_llm, checkpoint):
    path = checkpoint("llama_gqa")
    prompts = [[5, 9, 2, 7, 3] * 8, [11, 4, 8] * 20]
    from kvserve import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=12)
    lazy = make_llm(path, kv_cache_memory="64MiB")
    eager = make_llm(path, kv_cache_memory="64MiB", kv_cache_prefault=True)
    big = [
        t
        for t in pool_tensors(eager.engine.executor.driver_worker.storage)
        if t.numel() * t.element_size() >= PAGE
    ]
    assert min(resident_fraction(t) for t in big) == 1.0
    ref = [o.outputs[0].token_ids for o in lazy.generate(prompts, sp)]
    got = [o.outputs[0].token_ids for o in eager.generate(prompts, sp)]
    assert got == ref


def test_prefault_flag_and_field():
    from kvserve.cli import build_parser
    from kvserve.engine_args import engine_kwargs

    parser, _ = build_parser()
    args = parser.parse_args(["serve", "--kv-cache-prefault"])
    assert engine_kwargs(args)["kv_cache_prefault"] is True
    args = parser.parse_args(["serve"])
    assert engine_kwargs(args)["kv_cache_prefault"] is False
    with pytest.raises(ConfigError, match="kv_cache_prefault"):
        CacheConfig(kv_cache_prefault="yes")
