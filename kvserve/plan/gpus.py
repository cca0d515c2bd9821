"""Accelerators the planner knows, each figure with the vendor page it came from.

Capacities are the datasheet's "GB", which for HBM and GDDR parts are binary gigabytes (an
"80 GB" H100 reports 81,559 MiB to the driver), so they are read as GiB; bandwidth is decimal
TB/s as printed. Compute is dense BF16 tensor throughput: datasheets often print the 2:4-sparse
figure, which is twice the dense one and never reached by LLM inference, so it is halved here and
the source note says so. Anything else: ``--gpu custom:MEMORY_GIB:BANDWIDTH_TBS:BF16_TFLOPS``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class GPU:
    key: str
    name: str
    memory_gib: float
    bandwidth_tbs: float
    bf16_tflops: float
    source: str

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 1024**3

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_tbs * 1e12

    @property
    def flops_per_s(self) -> float:
        return self.bf16_tflops * 1e12


_NV = "https://www.nvidia.com/en-us/data-center"
GPUS: dict[str, GPU] = {
    g.key: g
    for g in (
        GPU("h100-sxm", "NVIDIA H100 SXM 80GB", 80, 3.35, 989.5,
            f"{_NV}/h100/ datasheet: 80 GB HBM3, 3.35 TB/s, BF16 1,979 TFLOPS with sparsity"),
        GPU("h100-pcie", "NVIDIA H100 PCIe 80GB", 80, 2.0, 756.5,
            f"{_NV}/h100/ datasheet: 80 GB HBM2e, 2 TB/s, BF16 1,513 TFLOPS with sparsity"),
        GPU("h100-nvl", "NVIDIA H100 NVL 94GB", 94, 3.9, 835.5,
            f"{_NV}/h100/ datasheet: 94 GB HBM3, 3.9 TB/s, BF16 1,671 TFLOPS with sparsity"),
        GPU("h200", "NVIDIA H200 SXM 141GB", 141, 4.8, 989.5,
            f"{_NV}/h200/ datasheet: 141 GB HBM3e, 4.8 TB/s, BF16 1,979 TFLOPS with sparsity"),
        GPU("a100-80gb", "NVIDIA A100 SXM 80GB", 80, 2.039, 312,
            f"{_NV}/a100/ datasheet: 80 GB HBM2e, 2,039 GB/s, BF16 312 TFLOPS dense"),
        GPU("a100-40gb", "NVIDIA A100 SXM 40GB", 40, 1.555, 312,
            f"{_NV}/a100/ datasheet: 40 GB HBM2, 1,555 GB/s, BF16 312 TFLOPS dense"),
        GPU("l40s", "NVIDIA L40S 48GB", 48, 0.864, 362.05,
            f"{_NV}/l40s/ datasheet: 48 GB GDDR6, 864 GB/s, BF16 362.05 TFLOPS dense"),
        GPU("l4", "NVIDIA L4 24GB", 24, 0.3, 121,
            f"{_NV}/l4/ datasheet: 24 GB GDDR6, 300 GB/s, BF16 242 TFLOPS with sparsity"),
        GPU("a10", "NVIDIA A10 24GB", 24, 0.6, 125,
            f"{_NV}/products/a10-gpu/ datasheet: 24 GB GDDR6, 600 GB/s, BF16 125 TFLOPS dense"),
        GPU("mi300x", "AMD Instinct MI300X 192GB", 192, 5.3, 1307.4,
            "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html: "
            "192 GB HBM3, 5.3 TB/s, BF16 1,307.4 TFLOPS dense"),
        GPU("mi325x", "AMD Instinct MI325X 256GB", 256, 6.0, 1307.4,
            "https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html: "
            "256 GB HBM3E, 6 TB/s, BF16 1,307.4 TFLOPS dense"),
    )
}  # fmt: skip


def get_gpu(spec: str) -> GPU:
    """A table entry by key (case-insensitive), or ``custom:MEM_GIB:BW_TBS:BF16_TFLOPS``."""
    key = spec.strip().lower()
    if key.startswith("custom:"):
        parts = key.split(":")[1:]
        try:
            mem, bw, tf = (float(x) for x in parts)
        except ValueError:
            raise ValueError(
                f"gpu: custom needs three numbers, custom:MEMORY_GIB:BANDWIDTH_TBS:BF16_TFLOPS, "
                f"got {spec!r}"
            ) from None
        if min(mem, bw, tf) <= 0:
            raise ValueError(f"gpu: custom figures must be > 0, got {spec!r}")
        return GPU("custom", f"custom {mem:g} GiB", mem, bw, tf, "given on the command line")
    if key not in GPUS:
        raise ValueError(f"gpu: unknown {spec!r}; known: {', '.join(GPUS)} or custom:...")
    return GPUS[key]


# NVLink per-GPU one-direction bandwidth by part (bytes/s), from the same datasheets (NVLink
# 900 GB/s both ways on H100/H200 SXM, 600 on A100 SXM and H100 NVL; Infinity Fabric 896 GB/s
# on MI300X/MI325X); a part not listed talks over PCIe.
INTERCONNECT = {
    "h100-sxm": 450e9, "h200": 450e9, "a100-80gb": 300e9, "a100-40gb": 300e9,
    "h100-nvl": 300e9, "mi300x": 448e9, "mi325x": 448e9,
}  # fmt: skip
# PCIe x16 one-direction peaks: Gen5 on the Hopper and MI300 parts, Gen4 on the others.
PCIE_GEN5 = ("h100-sxm", "h100-pcie", "h100-nvl", "h200", "mi300x", "mi325x")


def link_between_ranks(gpu_key: str) -> tuple[str, float]:
    """(link name, one-direction bytes/s per GPU) that tensor-parallel ranks of ``gpu_key``
    all-reduce over: NVLink where the part has it, else PCIe x16."""
    if gpu_key in INTERCONNECT:
        return "nvlink", INTERCONNECT[gpu_key]
    return ("pcie5", 64e9) if gpu_key in PCIE_GEN5 else ("pcie4", 32e9)
