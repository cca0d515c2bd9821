"""Ahead-of-time compilation of every Triton kernel variant the backend launches, for GPUs this
machine need not have: ``python -m kvserve.kernels.triton_aot [--arch 90 80]`` prints one JSON
line per (variant, architecture) and exits non-zero when any fails to compile or needs more
shared memory than the target gives one block.

Triton compiles for a :class:`~triton.backends.compiler.GPUTarget` without a driver (the PTX
assembler ships in its wheel), so CPU-only CI catches what the interpreter cannot: code that
does not lower to the GPU (layouts, dtype conversions, dot shapes) and tiles too large for
shared memory. The launches are built by the same function that launches them
(:func:`~kvserve.kernels.triton_attention.attention_launches`) over tensors on the ``meta``
device, so the compiled signatures are the launched ones.

Run it without ``TRITON_INTERPRET`` (under the interpreter ``triton.jit`` builds no compilable
functions); the test does so in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator

import torch

from kvserve.kernels import triton_attention as ta
from kvserve.kernels import triton_kv_write as tw

# Shared memory one block may use (the opt-in maximum), by compute capability.
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
_TYPES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8",
    torch.int8: "i8", torch.int64: "i64", torch.int32: "i32",
}  # fmt: skip
META = torch.device("meta")


def _t(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=META)


def _cache(fmt: str, dtype: torch.dtype, kvh: int, d: int, bs: int = 16, rows: int = 64):  # noqa: ANN202
    """A :class:`PagedCache` of format ``fmt`` on the meta device."""
    shape = (rows, kvh, bs, d)
    if fmt == "dense":
        return ta.PagedCache(ta.DENSE, _t(*shape, dtype=dtype), _t(*shape, dtype=dtype))
    if fmt.startswith("fp8"):
        u8 = _t(*shape, dtype=torch.uint8)
        return ta.PagedCache(ta.FP8, u8, u8, ks=_t(kvh, dtype=torch.float32),
                             vs=_t(kvh, dtype=torch.float32), e5m2=fmt == "fp8_e5m2")  # fmt: skip
    if fmt == "int8":
        i8, s = _t(*shape, dtype=torch.int8), _t(rows, kvh, bs, dtype=torch.float16)
        return ta.PagedCache(ta.INT8, i8, i8, ks=s, vs=s)
    bits = int(fmt.removeprefix("kivi"))
    group = 64 if bits == 4 else 32
    codes = _t(rows, kvh, bs, d * bits // 8, dtype=torch.uint8)
    vsz = _t(rows, kvh, bs, d // group, dtype=torch.float16)
    res = _t(8, kvh, bs, d, dtype=dtype)
    return ta.PagedCache(
        ta.KIVI, codes, codes, ks=_t(rows, kvh, 2, d, dtype=torch.uint8), vs=vsz,
        kz=_t(rows, kvh, 3, dtype=torch.float32), vz=vsz, res_map=_t(rows, dtype=torch.int64),
        rk=res, rv=res, rotation=_t(d, d, dtype=torch.float32), bits=bits, vgroup=group,
    )  # fmt: skip


def attention_variants(full: bool = False) -> Iterator[tuple[str, list]]:
    """(name, launches) for each variant: every format and compute dtype at head size 128 and
    8 query heads per KV head (decode rows), split-KV with its merge kernel, the dense
    group's StreamingLLM sinks and H2O mass; with ``full``
    also the paged group's query tiles, head size 256 (registers and shared memory at their
    tightest) and float32 KIVI with splits, which take CI minutes to compile."""
    b, kvh, g = 8, 8, 8
    bf16 = torch.bfloat16
    cases = [("dense", dt, 128, 1, 1, False) for dt in (torch.float32, bf16, torch.float16)]
    cases += [(f, bf16, 128, 1, 1, False) for f in ("fp8_e4m3", "fp8_e5m2", "int8")]
    cases += [(f, bf16, 128, 1, 1, False) for f in ("kivi4", "kivi2")]
    cases += [("dense", bf16, 128, 1, 16, False), ("dense", bf16, 128, 64, 1, True)]
    if full:
        cases += [("dense", bf16, 128, 64, 1, False), ("dense", bf16, 256, 1, 1, False)]
        cases += [("kivi4", bf16, 256, 1, 1, False), ("kivi4", torch.float32, 128, 1, 4, False)]
    for fmt, dt, d, block_q, splits, retention in cases:
        rows = b * block_q
        q = _t(rows, kvh * g, d, dtype=dt)
        i64 = _t(b, dtype=torch.int64)
        ws = _t(ta.workspace_numel(q, splits), dtype=torch.float32)
        i32 = _t(b, dtype=torch.int32)
        launches = ta.attention_launches(
            q, _cache(fmt, dt, kvh, d), q, i64, i64, i64, _t(b, 32, dtype=torch.int64), i32,
            0, rows, block_q, splits, ws, dt == torch.float32, i32 if retention else None,
            q if retention else None, (i64, i64) if retention else None,
        )  # fmt: skip
        name = f"attention-{fmt}-{str(dt).removeprefix('torch.')}-d{d}-q{block_q}-s{splits}"
        name += "-sinks-votes" if retention else ""
        yield name, launches


def write_variants() -> Iterator[tuple[str, list]]:
    """(name, launches) of the KV write kernels: each format and compute dtype (KIVI: its
    quantizing kernel and the residual's dense write)."""
    t, kvh, d = 16, 8, 128
    for fmt, dt in [("dense", torch.bfloat16), ("dense", torch.float32),
                    ("fp8_e4m3", torch.bfloat16), ("fp8_e5m2", torch.bfloat16),
                    ("int8", torch.bfloat16), ("int8", torch.float32)]:  # fmt: skip
        cache = _cache(fmt, dt, kvh, d)
        x = _t(t, kvh, d, dtype=dt)
        launches = tw.write_launches(cache, _t(t, dtype=torch.int64), x, x)
        yield f"write-{fmt}-{str(dt).removeprefix('torch.')}", launches
    i64, bf16 = torch.int64, torch.bfloat16
    for fmt in ("kivi4", "kivi2"):
        x = _t(t, kvh, d, dtype=bf16)
        step = tw.KiviStep(_t(4, dtype=i64), _t(4, 16, dtype=i64), _t(t, dtype=i64))
        launches = tw.kivi_launches(_cache(fmt, bf16, kvh, d), step, x, x,
                                    _t(256, dtype=torch.float32))  # fmt: skip
        yield f"write-{fmt}-bfloat16", launches


def signature(kernel, args: list, constexprs: dict) -> tuple[dict, dict]:  # noqa: ANN001
    """Triton's signature of a launch: each argument's type by name, constexprs by name."""
    names = kernel.arg_names
    sig: dict[str, str] = {}
    for name, a in zip(names, args, strict=False):
        if isinstance(a, torch.Tensor):
            sig[name] = "*" + _TYPES[a.dtype]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i32"
        else:
            sig[name] = "fp32"
    for name in constexprs:
        sig[name] = "constexpr"
    return sig, dict(constexprs)


def jobs(full: bool) -> list[tuple[str, int, int]]:
    """(variant, launch index, architecture) of every compilation."""
    out = []
    for name, launches in [*attention_variants(full), *write_variants()]:
        out += [(name, i, 0) for i in range(len(launches))]
    return out


def compile_one(job: tuple[str, int, int], full: bool) -> dict:
    """Compile one launch of one variant for one architecture: its record."""
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name, index, arch = job
    launches = dict([*attention_variants(full), *write_variants()])[name]
    kernel, _grid, args, constexprs = launches[index]
    sig, consts = signature(kernel, args, constexprs)
    rec: dict = {"variant": name, "kernel": kernel.fn.__name__, "arch": f"sm_{arch}"}
    start = time.perf_counter()
    try:
        src = ASTSource(fn=kernel, signature=sig, constexprs=consts)
        options = {"num_warps": ta.NUM_WARPS, **tw.LAUNCH_OPTIONS.get(kernel.fn.__name__, {})}
        k = triton_compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        rec.update(ok=k.metadata.shared <= SHARED_LIMIT[arch] and bool(k.asm.get("cubin")),
                   shared=k.metadata.shared, limit=SHARED_LIMIT[arch],
                   cubin_bytes=len(k.asm.get("cubin", b"")))  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the record says what failed
        rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
    rec["seconds"] = round(time.perf_counter() - start, 2)
    return rec


def compile_all(archs: list[int], full: bool = False, workers: int = 1) -> list[dict]:
    """Compile every variant for each architecture, ``workers`` processes at a time; one
    record per (variant, kernel, architecture)."""
    todo = [(name, i, arch) for name, i, _ in jobs(full) for arch in archs]
    if workers <= 1:
        return [compile_one(j, full) for j in todo]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(compile_one, todo, [full] * len(todo)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=sorted(SHARED_LIMIT))
    p.add_argument("--full", action="store_true", help="also the variants slow to compile")
    p.add_argument("--workers", type=int, default=1, help="compiler processes at a time")
    args = p.parse_args(argv)
    records = compile_all(args.arch, args.full, args.workers)
    for r in records:
        print(json.dumps(r))
    return 0 if records and all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
