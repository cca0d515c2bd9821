"""Block exports and imports between a pool and host memory: bit-exact on every device, and on
CUDA asynchronous (pinned host memory, a copy stream) without ever reading a block too early
or too late. The CUDA tests need a GPU; CI has none, so they run where one is lent
(``benchmarks/cuda_smoke.sh``)."""

from __future__ import annotations

import pytest
import torch

from kvserve.kv.formats import make_kv_storage
from kvserve.kv.storage import BlockPayload

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GEOMETRY = dict(num_layers=3, num_blocks=12, block_size=4, num_kv_heads=2, head_dim=8)


def filled(name: str, device: str, seed: int = 0):
    """A pool of format ``name`` whose every block tensor holds seeded random bytes."""
    storage = make_kv_storage(name, **GEOMETRY, dtype=torch.float32, device=device)
    g = torch.Generator().manual_seed(seed)
    for ts in storage.block_tensors().values():
        for t in ts:
            raw = torch.randint(0, 256, t.shape + (t.element_size(),), generator=g)
            t.copy_(raw.to(torch.uint8).view(t.dtype).reshape(t.shape).to(device))
    return storage


def host_blocks(storage, ids: list[int]) -> dict[str, torch.Tensor]:
    """The naive reference: every layer's rows ``ids``, copied to the host one by one."""
    return {
        name: torch.stack([torch.stack([t[i].cpu() for i in ids]) for t in ts])
        for name, ts in storage.block_tensors().items()
    }


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("fmt", ["float32", "fp8_e4m3", "int8"])
def test_cpu_export_is_ready_and_exact(fmt):
    storage = filled(fmt, "cpu")
    ids = [7, 2, 9]
    payload = storage.export_blocks(ids)
    assert payload.ready is None  # nothing in flight on the CPU
    want = host_blocks(storage, ids)
    assert payload.tensors.keys() == want.keys()
    assert all(same_bytes(payload.tensors[k], want[k]) for k in want)
    other = filled(fmt, "cpu", seed=1)
    other.import_blocks([0, 5, 11], payload)
    got = host_blocks(other, [0, 5, 11])
    assert all(same_bytes(got[k], want[k]) for k in want)


def test_wait_on_a_cpu_payload_returns_it_unchanged():
    t = {"k": torch.arange(6.0).reshape(1, 2, 3)}
    p = BlockPayload({"format": "x"}, 2, t)
    assert p.wait() is p and p.tensors["k"] is t["k"]


@cuda
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "fp8_e4m3", "int8"])
def test_gpu_export_is_pinned_exact_and_waits(fmt):
    storage = filled(fmt, "cuda")
    ids = [7, 2, 9, 0]
    want = host_blocks(storage, ids)
    payload = storage.export_blocks(ids)
    assert payload.ready is not None, "a GPU export should copy on its stream, not block"
    payload.wait()
    assert payload.ready is None
    for name, t in payload.tensors.items():
        assert t.device.type == "cpu" and t.is_pinned(), name
        assert same_bytes(t, want[name]), name


@cuda
def test_gpu_export_reads_the_blocks_as_they_were_when_exported():
    """Blocks freed by an eviction are written again by the next step at once: the export's
    copy must hold the bytes of the moment it was asked for, not later ones."""
    storage = filled("float32", "cuda")
    ids = list(range(GEOMETRY["num_blocks"]))
    want = host_blocks(storage, ids)
    payload = storage.export_blocks(ids)
    for ts in storage.block_tensors().values():  # the next step overwrites every block
        for t in ts:
            t.mul_(0).add_(-1)
    payload.wait()
    assert all(same_bytes(payload.tensors[k], want[k]) for k in want)


@cuda
def test_gpu_import_of_a_pinned_payload_is_visible_to_the_next_kernels():
    src = filled("float32", "cuda")
    ids = [3, 8, 1]
    payload = src.export_blocks(ids).wait().pinned()
    assert all(t.is_pinned() for t in payload.tensors.values())
    dst = filled("float32", "cuda", seed=2)
    dst.import_blocks([10, 4, 6], payload)
    # a kernel on the compute stream right after the import, no synchronisation between
    read = {k: torch.stack([t[[10, 4, 6]].clone() for t in ts])
            for k, ts in dst.block_tensors().items()}  # fmt: skip
    want = host_blocks(src, ids)
    assert all(same_bytes(read[k].cpu(), want[k]) for k in want)
    got = host_blocks(dst, [10, 4, 6])
    assert all(same_bytes(got[k], want[k]) for k in want)


@cuda
def test_gpu_engine_tiers_pin_their_loads(checkpoint, make_llm):
    from tests.test_kv_offload import POOL, evict_and_return, prompts_of_lengths

    prompt, *flood = prompts_of_lengths([200, 200, 200, 200], vocab=320, seed=5)
    plain = make_llm(checkpoint("llama_gqa"), device="cuda", **POOL)
    tiered = make_llm(checkpoint("llama_gqa"), device="cuda", kv_offload_cpu="4MiB", **POOL)
    first, second, cached = evict_and_return(plain, prompt, flood)
    assert cached == 0
    got = evict_and_return(tiered, prompt, flood)
    assert tiered.engine.offload.pin_memory
    assert got[2] > 0, "the prompt should come back from the host tier"
    assert got[:2] == (first, second)
