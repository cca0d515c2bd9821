"""The Triton backend on a GPU, in one run writing one JSON (``benchmarks/gpu_check.sh``).

1. versions (torch, triton, CUDA, the card) and the measured device-to-device copy bandwidth;
2. the kernel tests (``tests/test_triton_attention.py``, ``tests/test_triton_kv_write.py``)
   compiled on CUDA (``KVSERVE_TEST_DEVICE=cuda``), greedy tokens of the bundled model in
   float32 through ``triton`` against ``torch`` among them; then the kernels at GPU sizes:
   each format's decode through the ``triton`` backend against the ``torch`` backend (gather +
   SDPA) over the same stored codes, windows on half the rows, a forced split-KV, and the
   write kernels against the storages' writes, bit for bit; KIVI's write kernels against the
   storage's torch ops (a prefill and a decode step), seconds per call;
3. decode bandwidth per format at batch ``--batch`` x contexts ``--contexts`` (one layer of a
   Llama-8B-shaped model: 32 query heads, 8 KV heads, head size 128, bf16): the kernel alone,
   bytes of KV read per second as a share of the measured copy bandwidth and of the
   datasheet peak, sequences x tokens per second; and the ``torch`` backend's decode on the
   same storage and rows.

``--dry-run`` parses the arguments and prints the plan without touching a GPU; ``--device cpu``
runs the whole script on tiny sizes under Triton's interpreter (``TRITON_INTERPRET=1``), to
check the script itself where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

FORMATS = ["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "kivi4", "kivi2"]
HEADS, KV_HEADS, D, BS = 32, 8, 128, 16
# (atol, rtol) of the triton decode against the torch backend's over the same codes: one
# bf16 rounding of the output either way (vLLM's kernel tests take 1.5e-2 / 1e-2).
TOL = (1.5e-2, 1e-2)
H100_PEAK = 3.35e12  # bytes/s, H100 SXM datasheet
DEV = torch.device("cuda")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check.json", help="the JSON written at the end")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--formats", nargs="+", default=FORMATS, choices=FORMATS)
    p.add_argument("--iters", type=int, default=20, help="timed calls per measurement")
    p.add_argument("--check-batch", type=int, default=64, help="rows of the kernel checks")
    p.add_argument("--check-context", type=int, default=1000, help="their context")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--no-pytest", action="store_true", help="leave the kernel tests out")
    p.add_argument("--peak", type=float, default=H100_PEAK, help="datasheet bytes/s")
    p.add_argument("--dry-run", action="store_true", help="print the plan; touch no GPU")
    args = p.parse_args(argv)
    if min(args.batch, *args.contexts, args.iters, args.check_batch, args.check_context) < 1:
        p.error("--batch, --contexts, --iters, --check-batch and --check-context must be >= 1")
    return args


def versions() -> dict:
    import triton

    out = {"torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version()}  # fmt: skip
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1))  # fmt: skip
    try:
        out["git"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                    text=True, timeout=5).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def timed(fn, iters: int) -> float:  # noqa: ANN001
    """Median seconds per call of ``fn`` on the current stream (CUDA events)."""
    for _ in range(3 if DEV.type == "cuda" else 1):
        fn()
    if DEV.type == "cpu":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(iters: int) -> float:
    """Bytes moved (read + written) per second by a 1 GiB device-to-device copy."""
    src = torch.empty(2**30 if DEV.type == "cuda" else 2**24, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), iters)


def filled(fmt: str, batch: int, ctx: int, seed: int = 0):  # noqa: ANN202
    """A one-layer storage holding ``batch`` sequences of ``ctx`` tokens, written as prefills
    through the storage (so each format's codes are its own), shuffled block tables, and the
    decode rows' queries."""
    from kvserve.kv.formats import make_kv_storage

    dev = DEV
    blocks = -(-ctx // BS)
    dt = torch.float16 if fmt == "float16" else torch.bfloat16
    st = make_kv_storage(fmt, 1, batch * blocks, BS, KV_HEADS, D, dt, dev, max_num_seqs=batch)
    g = torch.Generator(device=dev).manual_seed(seed)
    tables = torch.randperm(batch * blocks, device=dev, generator=g).view(batch, blocks)
    for i in range(0, batch, 8):  # a few sequences per write: bounded temporaries
        t = tables[i : i + 8]
        slots = (t[:, :, None] * BS + torch.arange(BS, device=dev)).reshape(t.shape[0], -1)
        slots = slots[:, :ctx].reshape(-1)
        k = torch.randn(len(slots), KV_HEADS, D, device=dev, generator=g, dtype=dt)
        v = torch.randn(len(slots), KV_HEADS, D, device=dev, generator=g, dtype=dt)
        st.begin_step(slots)
        st.write(0, slots, k, v)
    q = torch.randn(batch, HEADS, D, device=dev, generator=g, dtype=dt)
    lens = torch.full((batch,), ctx, device=dev)
    return st, tables, lens, q


def torch_decode(st, q, tables, lens, windows=None):  # noqa: ANN001, ANN201
    """The torch backend's decode rows: gather + SDPA with a length mask."""
    from kvserve.attention.metadata import AttentionMetadata

    meta = AttentionMetadata(slot_mapping=lens, block_size=BS, num_decode=q.shape[0],
                             decode_block_tables=tables, decode_seq_lens=lens,
                             decode_windows=windows)  # fmt: skip
    kc, vc = st.gather(0, tables)
    qd = q.view(q.shape[0], KV_HEADS, -1, D)
    o = torch.nn.functional.scaled_dot_product_attention(
        qd, kc.to(q.dtype), vc.to(q.dtype), attn_mask=meta.decode_mask(None)
    )
    return o.reshape(q.shape)


def check_kernels(formats: list[str], batch: int, ctx: int) -> list[dict]:
    """Each format's triton decode against the torch backend's at ``batch`` x ``ctx`` (a
    window of 30 % of the context on every other row), once more with four key splits forced;
    the write kernels bit for bit."""
    from kvserve.attention.triton_backend import TritonBackend, paged_cache
    from kvserve.kernels import triton_attention as ta
    from kvserve.kernels.triton_kv_write import kv_write
    from kvserve.kv.formats import make_kv_storage

    out = []
    backend = TritonBackend()
    for fmt in formats:
        st, tables, lens, q = filled(fmt, batch, ctx, seed=1)
        rows = torch.arange(batch, device=DEV)
        windows = torch.where(rows % 2 == 0, 0, max(1, ctx * 3 // 10)).int()
        want = torch_decode(st, q, tables, lens, windows)
        rec = {"check": "decode", "format": fmt}
        for splits in (None, 4):
            real = ta.choose_splits
            if splits:
                ta.choose_splits = lambda *a, s=splits: s
            try:
                got = backend.decode(0, q, st, tables, lens, None, windows)
            finally:
                ta.choose_splits = real
            err = (got.float() - want.float()).abs()
            ok = bool((err <= TOL[0] + TOL[1] * want.float().abs()).all())
            rec[f"max_abs_err{'_split' if splits else ''}"] = float(err.max())
            rec["ok"] = rec.get("ok", True) and ok and not bool(got.isnan().any())
        out.append(rec)
        del st
    for fmt in ("bfloat16", "fp8_e4m3", "fp8_e5m2", "int8"):
        dt = torch.bfloat16
        n = 4096 if DEV.type == "cuda" else 64
        a = make_kv_storage(fmt, 1, n // 8, BS, KV_HEADS, D, dt, DEV)
        b = make_kv_storage(fmt, 1, n // 8, BS, KV_HEADS, D, dt, DEV)
        slots = torch.randperm(n // 8 * BS, device=DEV)[:n]
        k = torch.randn(n, KV_HEADS, D, device=DEV, dtype=dt) * 3
        v = torch.randn(n, KV_HEADS, D, device=DEV, dtype=dt)
        for s in (a, b):
            s.write(0, slots[:64], k[:64], v[:64])  # fp8: the same calibration
        a.write(0, slots, k, v)
        kv_write(paged_cache(b, 0), slots, k, v)
        same = all(torch.equal(x[0].view(torch.uint8), b.block_tensors()[n][0].view(torch.uint8))
                   for n, x in a.block_tensors().items())  # fmt: skip
        out.append({"check": "write", "format": fmt, "ok": same})
    return out


def kernel_tests(device: str) -> dict:
    """The Triton tests on ``device`` (compiled kernels on cuda): exit status and summary."""
    import os

    env = {**os.environ, "KVSERVE_TEST_DEVICE": device,
           "TRITON_INTERPRET": "1" if device == "cpu" else "0"}  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short",
           "tests/test_triton_attention.py", "tests/test_triton_kv_write.py"]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    except subprocess.TimeoutExpired:
        return {"check": "pytest", "ok": False, "tail": "timed out after 240 s"}
    tail = (proc.stdout + proc.stderr)[-3000:]
    return {"check": "pytest", "ok": proc.returncode == 0, "returncode": proc.returncode,
            "tail": tail}  # fmt: skip


def kv_bytes(st, batch: int, ctx: int) -> int:  # noqa: ANN001
    """Bytes of stored KV (codes and metadata) the decode of ``batch`` x ``ctx`` reads."""
    return int(st.nbytes() / st.num_blocks * -(-ctx // BS) * batch)


def bandwidth(formats: list[str], batch: int, contexts: list[int], iters: int,
              copy_bw: float, peak: float) -> list[dict]:  # fmt: skip
    from kvserve.attention.triton_backend import TritonBackend

    backend, rows = TritonBackend(), []
    for ctx in contexts:
        for fmt in formats:
            nbytes, t_kernel, t_torch = measure(backend, fmt, batch, ctx, iters)
            rows.append({
                "format": fmt, "batch": batch, "context": ctx, "kv_bytes": nbytes,
                "triton_s": t_kernel, "torch_s": t_torch,
                "triton_bytes_per_s": nbytes / t_kernel,
                "pct_of_copy": 100 * nbytes / t_kernel / copy_bw,
                "pct_of_peak": 100 * nbytes / t_kernel / peak,
                "seq_tokens_per_s": batch * ctx / t_kernel,
                "speedup_vs_torch": t_torch / t_kernel,
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            if DEV.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def measure(backend, fmt: str, batch: int, ctx: int, iters: int) -> tuple[int, float, float]:  # noqa: ANN001
    """(KV bytes read, triton seconds, torch seconds) of one decode step's attention."""
    st, tables, lens, q = filled(fmt, batch, ctx)
    t_kernel = timed(lambda: backend.decode(0, q, st, tables, lens, None, None), iters)
    t_torch = timed(lambda: torch_decode(st, q, tables, lens), max(3, iters // 4))
    return kv_bytes(st, batch, ctx), t_kernel, t_torch


def kivi_write_speed(iters: int) -> list[dict]:
    """KIVI's write of one layer through the Triton kernels against the storage's torch ops,
    for a prefill (whole blocks quantized at once) and a decode step (tokens into their
    residual slots): seconds per call each and the ratio. The step plan is made once, outside
    the timing, as the runner makes it once per step for every layer."""
    import numpy as np

    from kvserve.attention.triton_backend import TritonBackend
    from kvserve.kv.formats import make_kv_storage

    big = DEV.type == "cuda"
    seqs, prompt = (64, 512) if big else (2, 32)
    nblk = -(-prompt // BS) + 1
    out = []
    backend = TritonBackend()
    for fmt in ("kivi4", "kivi2"):
        st = make_kv_storage(fmt, 1, seqs * nblk + 1, BS, KV_HEADS, D, torch.bfloat16, DEV,
                             max_num_seqs=seqs)  # fmt: skip
        base = np.arange(seqs)[:, None] * nblk * BS
        prefill = (base + np.arange(prompt)).reshape(-1)
        decode = base[:, 0] + prompt  # the next entry of each sequence: a residual block
        for name, slots in (("prefill", prefill), ("decode", decode)):
            st.begin_step(slots)
            s = torch.from_numpy(slots).to(DEV)
            k = torch.randn(len(slots), KV_HEADS, D, device=DEV, dtype=torch.bfloat16)
            ref = timed(lambda st=st, s=s, k=k: st.write(0, s, k, k), iters)
            tri = timed(lambda st=st, s=s, k=k: backend.write_kv(0, st, s, k, k), iters)
            out.append({"format": fmt, "step": name, "tokens": len(slots),
                        "torch_s": ref, "triton_s": tri, "speedup": ref / tri})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = {"formats": args.formats, "batch": args.batch, "contexts": args.contexts,
            "iters": args.iters, "out": args.out}  # fmt: skip
    if args.dry_run:
        print(json.dumps({"plan": plan}))
        return 0
    global DEV
    DEV = torch.device(args.device)
    if DEV.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    start = time.time()
    result: dict = {"plan": plan, "versions": versions()}
    result["copy_bytes_per_s"] = copy_bw = copy_bandwidth(args.iters)
    result["checks"] = [] if args.no_pytest else [kernel_tests(args.device)]
    print(json.dumps({k: v for k, v in result["checks"][0].items() if k != "tail"})
          if result["checks"] else "{}", flush=True)  # fmt: skip
    result["checks"] += check_kernels(args.formats, args.check_batch, args.check_context)
    result["kivi_write"] = kivi_write_speed(args.iters)
    result["bandwidth"] = bandwidth(args.formats, args.batch, args.contexts, args.iters,
                                    copy_bw, args.peak)  # fmt: skip
    by = {(r["format"], r["context"]): r for r in result["bandwidth"]}
    ctx = max(args.contexts)
    if ("bfloat16", ctx) in by:
        bf16 = by[("bfloat16", ctx)]["seq_tokens_per_s"]
        result["vs_bf16"] = {f: by[(f, ctx)]["seq_tokens_per_s"] / bf16
                             for f in args.formats if (f, ctx) in by}  # fmt: skip
    result["seconds"] = time.time() - start
    result["ok"] = all(c["ok"] for c in result["checks"])
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({"ok": result["ok"], "out": args.out, "seconds": result["seconds"]}))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
