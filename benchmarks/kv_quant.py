"""KV cache quantization end to end: bytes, capacity, decode step time and throughput per
storage format, each relative to a bfloat16 cache, plus the codec-error measurement behind
KIVI's group sizes and metadata types.

1. bytes/token on a Llama-3-8B shape (32 layers, 8 KV heads, head dim 128), metadata included;
2. capacity: concurrent 4k-token sequences the engine's pool really admits (allocate_slots
   until it says no) in one fixed ``kv_cache_memory``;
3. decode step time at equal batch and context (the dequantization overhead): all formats
   step round-robin in one process; the figure is the median over rounds of each format's
   step time divided by bfloat16's in the same round, which cancels drifting background load;
4. a long-context, decode-heavy workload in a fixed ``kv_cache_memory`` small enough that
   bfloat16 is KV-bound (it cannot run every sequence at once): output tokens/s;
5. codec error on real K/V of the model (relative Frobenius error of K and V) for candidate
   key-metadata layouts and value group sizes.

Compute is float32 (faster than bfloat16 matmuls on these CPUs); the baseline cache is
bfloat16, served by the dense fused kernel; the quantized formats by theirs. One thread
unless KVSERVE_BENCH_THREADS says otherwise. ``--quick`` finishes in under a minute.

    .venv/bin/python benchmarks/kv_quant.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from benchmarks.common import (
    bench_model,
    drain,
    emit,
    median,
    random_prompts,
    set_threads,
    table,
)

FORMATS = ["bfloat16", "fp8_e4m3", "fp8_e5m2", "int8", "kivi4", "kivi2"]


def bytes_section() -> dict[str, float]:
    from kvserve.kv.formats import kv_bytes_per_token

    base = kv_bytes_per_token("bfloat16", 32, 8, 128, "bfloat16")
    rows, ratio = [], {}
    for f in FORMATS:
        row = {"format": f}
        for bs in (16, 32, 64):
            b = kv_bytes_per_token(f, 32, 8, 128, "bfloat16", block_size=bs)
            row[f"KiB/tok bs{bs}"] = b / 1024
            row[f"ratio bs{bs}"] = b / base
            row[f"bits/elem bs{bs}"] = b * 8 / (2 * 32 * 8 * 128)
        ratio[f] = round(row["ratio bs16"], 5)
        rows.append(row)
    print("\n## bytes per token, Llama-3-8B shape (32 x 8 x 128), bf16 = 128 KiB")
    print(
        table(
            rows,
            ["format", "KiB/tok bs16", "ratio bs16", "bits/elem bs16", "ratio bs32", "ratio bs64"],
        )
    )
    return ratio


def engine(model: str, fmt: str, **kw):
    from kvserve import LLM

    return LLM(model, dtype="float32", kv_cache_dtype=fmt, **kw).engine


def capacity_section(
    model: str, memory: int, seq_len: int = 4096
) -> tuple[dict[str, float], dict[str, float]]:
    """Sequences the pool admits, and the same count if KIVI's residual (one full-precision
    block per running sequence, kept outside ``kv_cache_memory``) had to fit inside it."""
    from kvserve.sched.request import Request, SamplingParams

    rows, held, strict = [], {}, {}
    for f in FORMATS:
        e = engine(model, f, kv_cache_memory=memory, max_model_len=seq_len + 16)
        reqs = []
        while True:
            r = Request(f"cap{len(reqs)}", [0] * seq_len, SamplingParams(max_tokens=1), 1)
            if not e.kv.allocate_slots(r, seq_len):
                break
            reqs.append(r)
        for r in reqs:
            e.kv.free(r)
        held[f] = len(reqs)
        st = e.executor.driver_worker.storage
        res_block = st.fixed_nbytes() / st.res_k[0].shape[0] if hasattr(st, "res_k") else 0.0
        per_seq = -(-seq_len // e.block_size) * e.block_size * e.bytes_per_token + res_block
        strict[f] = int(memory // per_seq)
        rows.append(
            {
                "format": f,
                "blocks": e.num_blocks,
                "4k seqs": len(reqs),
                "incl. residual": strict[f],
                "pool MiB": st.nbytes() / 2**20,
                "residual KiB/seq": res_block / 1024,
            }
        )
    print(f"\n## capacity: {seq_len}-token sequences in kv_cache_memory = {memory / 2**20:.0f} MiB")
    cols = ["format", "blocks", "4k seqs", "incl. residual", "pool MiB", "residual KiB/seq"]
    print(table(rows, cols))
    base = held["bfloat16"]
    return (
        {f: round(held[f] / base, 4) for f in FORMATS},
        {f: round(strict[f] / base, 4) for f in FORMATS},
    )


def step_time_section(model: str, batch: int, context: int, steps: int) -> dict[str, float]:
    from kvserve.sched.request import SamplingParams

    engines = {}
    prompts = random_prompts(batch, context, context, 4096, seed=1)
    sp = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for f in FORMATS:
        e = engine(
            model,
            f,
            max_num_seqs=batch,
            max_model_len=context + steps + 16,
            max_num_batched_tokens=4096,
            num_gpu_blocks=batch * ((context + steps) // 16 + 4),
        )
        for p in prompts:
            e.add_request(None, p, sp)
        while e.stats().step_decode_tokens < batch:  # until every sequence decodes
            e.step()
        engines[f] = e
    times: dict[str, list[float]] = {f: [] for f in FORMATS}
    for _ in range(steps):
        for f, e in engines.items():
            t0 = time.perf_counter()
            e.step()
            times[f].append(time.perf_counter() - t0)
    for e in engines.values():
        for rid in list(e.requests):
            e.abort_request(rid)
    med = {f: median(t) for f, t in times.items()}
    # Per-round ratios cancel load that drifts between rounds (the machine is shared).
    paired = {f: median([a / b for a, b in zip(times[f], times["bfloat16"], strict=True)])
              for f in FORMATS}  # fmt: skip
    rows = [{"format": f, "step ms": med[f] * 1e3, "ratio of medians": med[f] / med["bfloat16"],
             "median of ratios": paired[f]} for f in FORMATS]  # fmt: skip
    print(f"\n## decode step time: batch {batch}, context {context}, {steps} rounds")
    print(table(rows, ["format", "step ms", "ratio of medians", "median of ratios"]))
    return {f: round(paired[f], 4) for f in FORMATS}


def throughput_section(
    model: str, n: int, prompt: int, out: int, bf16_seqs: float
) -> tuple[dict[str, float], dict[str, float]]:
    """``kv_cache_memory`` holds ``bf16_seqs`` full sequences in bfloat16, so bfloat16 runs
    that many at a time while the quantized formats run more (up to all ``n``)."""
    from kvserve.config import ModelConfig
    from kvserve.kv.formats import kv_bytes_per_token
    from kvserve.sched.request import SamplingParams

    mc = ModelConfig.from_pretrained(model)
    bpt = kv_bytes_per_token("bfloat16", mc.num_hidden_layers, mc.num_key_value_heads,
                             mc.head_dim, "float32")  # fmt: skip
    memory = int(bf16_seqs * (prompt + out + 16) * bpt)
    prompts = random_prompts(n, prompt - prompt // 8, prompt, 4096, seed=2)
    sp = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    tok_s, rows = {}, []
    for f in FORMATS:
        e = engine(
            model,
            f,
            kv_cache_memory=memory,
            max_num_seqs=n,
            max_model_len=prompt + out + 16,
            enable_prefix_caching=False,
        )
        run = drain(e, prompts, sp)
        tok_s[f] = n * out / run["wall s"]
        rows.append({"format": f, "blocks": e.num_blocks, **run, "out tok/s": tok_s[f]})
    print(
        f"\n## long-context decode-heavy: {n} requests, prompt <= {prompt}, {out} out, "
        f"kv_cache_memory {memory / 2**20:.1f} MiB"
    )
    print(table(rows, ["format", "blocks", "peak running", "preemptions", "wall s", "out tok/s"]))
    return {f: round(tok_s[f] / tok_s["bfloat16"], 4) for f in FORMATS}, tok_s


def capture_kv(model: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one n-token prompt through the model: [layers * kvh, n, d] each."""
    from kvserve.attention.metadata import AttentionMetadata, PrefillChunk
    from kvserve.config import ModelConfig
    from kvserve.kv.storage import DenseKVStorage
    from kvserve.model.loader import load_model

    mc = ModelConfig.from_pretrained(model)
    m = load_model(model, mc, torch.float32, torch.device("cpu"), n + 16)
    st = DenseKVStorage(
        mc.num_hidden_layers, n, 1, mc.num_key_value_heads, mc.head_dim, torch.float32
    )
    ids = torch.tensor(random_prompts(1, n, n, mc.vocab_size, seed=3)[0])
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), block_size=1, prefills=[PrefillChunk(0, n, 0, None)]
    )
    with torch.inference_mode():
        m(ids, torch.arange(n), st, meta)
    k = torch.cat([t[:, :, 0].transpose(0, 1) for t in st.k])
    v = torch.cat([t[:, :, 0].transpose(0, 1) for t in st.v])
    return k, v


def codec_error_section(model: str, n: int) -> list[dict]:
    """Relative error of keys and values for candidate KIVI layouts (the measurement behind
    the defaults): keys with compact 8-bit per-channel metadata vs float16 pairs, per block
    size; values per token with float16 pairs over groups of 32/64/128 channels."""
    from kvserve.kv import codecs
    from kvserve.kv.kivi_storage import hadamard

    k, v = capture_kv(model, n)
    h, _, d = k.shape
    rows = []

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    rot = hadamard(d)
    for bits in (4, 2):
        for bs in (16, 32, 64):
            meta_bits = bits + (2 * 8 + 96 / d) / bs  # uint8 zero + scale per channel, 3 float32
            kb = k[:, : n // bs * bs].reshape(h, -1, bs, d)
            ours = codecs.kivi_dequantize_keys(*codecs.kivi_quantize_keys(kb, bits), bits=bits)
            t = kb.transpose(-1, -2)  # fp16 (scale, zero) per channel: values codec along tokens
            pair = codecs.kivi_dequantize_values(*codecs.kivi_quantize_values(t, bits, bs), bits)
            rows.append(
                {
                    "codec": f"kivi{bits} keys",
                    "layout": f"bs{bs} 8-bit meta",
                    "bits/elem": meta_bits,
                    "rel err": rel(ours, kb),
                }
            )
            if rot is not None and bs == 16:  # the engine's layout: rotated, then quantized
                kr = codecs.kivi_quantize_keys(kb @ rot, bits)
                back = codecs.kivi_dequantize_keys(*kr, bits=bits) @ rot.T
                rows.append({"codec": f"kivi{bits} keys", "layout": f"bs{bs} 8-bit, Hadamard",
                             "bits/elem": meta_bits,
                             "rel err": rel(back, kb)})  # fmt: skip
            rows.append(
                {
                    "codec": f"kivi{bits} keys",
                    "layout": f"bs{bs} fp16 pair",
                    "bits/elem": bits + 32 / bs,
                    "rel err": rel(pair.transpose(-1, -2), kb),
                }
            )
        for g in (32, 64, 128):
            if d % g:
                continue
            back = codecs.kivi_dequantize_values(*codecs.kivi_quantize_values(v, bits, g), bits)
            rows.append(
                {
                    "codec": f"kivi{bits} values",
                    "layout": f"group {g} fp16 pair",
                    "bits/elem": bits + 32 / g,
                    "rel err": rel(back, v),
                }
            )
    c, s = codecs.int8_quantize(k)
    rows.append(
        {
            "codec": "int8 keys",
            "layout": "per token, fp16 scale",
            "bits/elem": 8 + 16 / d,
            "rel err": rel(codecs.int8_dequantize(c, s), k),
        }
    )
    for name, dt in codecs.FP8_DTYPES.items():
        scale = codecs.fp8_scale_from_amax(k.abs().amax(dim=(1, 2)), dt, 4.0)[:, None, None]
        back = codecs.fp8_dequantize(codecs.fp8_quantize(k, scale, dt), scale, dt, torch.float32)
        rows.append(
            {
                "codec": f"{name} keys",
                "layout": "per head, x4 headroom",
                "bits/elem": 8,
                "rel err": rel(back, k),
            }
        )
    print(f"\n## codec error on this model's K/V ({n}-token prompt, head dim {d})")
    print(table(rows, ["codec", "layout", "bits/elem", "rel err"]))
    return rows


def path_logits(model, mc, fmt: str, prompt: list[int], path: list[int], greedy: bool):
    """Logits along a token path, decoding one token at a time through ``fmt``'s storage.
    With ``greedy`` the path is extended by the argmax instead (returns logits, path)."""
    from kvserve.attention.metadata import AttentionMetadata, PrefillChunk
    from kvserve.kv.formats import make_kv_storage

    bs, n = 16, len(prompt)
    nb = (n + max(len(path), int(greedy)) + 2 * bs) // bs
    st = make_kv_storage(fmt, mc.num_hidden_layers, nb, bs, mc.num_key_value_heads,
                         mc.head_dim, torch.float32)  # fmt: skip
    table = torch.arange(nb)[None]
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_size=bs,
                             prefills=[PrefillChunk(0, n, 0, None)])  # fmt: skip
    with torch.inference_mode():
        st.begin_step(meta.slot_mapping)
        out = [model.logits(model(torch.tensor(prompt), torch.arange(n), st, meta)[-1:])]
        path = list(path)
        for i in range(len(path) if not greedy else 10**9):
            if greedy:
                if len(path) == greedy:
                    break
                path.append(int(out[-1].argmax()))
            p = n + i
            meta = AttentionMetadata(slot_mapping=torch.tensor([p]), block_size=bs, num_decode=1,
                                     decode_block_tables=table[:, : p // bs + 1],
                                     decode_seq_lens=torch.tensor([p + 1]))  # fmt: skip
            st.begin_step(meta.slot_mapping)
            out.append(model.logits(model(torch.tensor([path[i]]), torch.tensor([p]), st, meta)))
    return torch.cat(out), path


def agreement_section(
    model_dir: str, prompts: int, prompt_len: int, steps: int, text: str | None = None
) -> dict:
    """Teacher-forced top-1 agreement and KL(bf16 || format) along the bf16 cache's own
    greedy path: every format sees the same tokens, so one early flip does not decide the rest."""
    from kvserve.config import ModelConfig
    from kvserve.model.loader import load_model

    mc = ModelConfig.from_pretrained(model_dir)
    model = load_model(model_dir, mc, torch.float32, torch.device("cpu"), prompt_len + steps + 32)
    agree: dict[str, list[float]] = {f: [] for f in FORMATS}
    kl: dict[str, list[float]] = {f: [] for f in FORMATS}
    inputs = random_prompts(prompts, prompt_len, prompt_len, mc.vocab_size, seed=7)
    tok_path = Path(model_dir) / "tokenizer.json"
    if text and tok_path.exists():  # windows of real text: what a trained model expects
        from kvserve.model.tokenizer import Tokenizer

        ids = Tokenizer(Path(model_dir), mc.eos_token_ids).encode(text)
        stride = max(1, (len(ids) - prompt_len) // max(1, prompts - 1))
        inputs = [ids[i * stride : i * stride + prompt_len] for i in range(prompts)]
        inputs = [p for p in inputs if len(p) == prompt_len] or inputs[:1]
    for prompt in inputs:
        base, path = path_logits(model, mc, "bfloat16", prompt, [], greedy=steps)
        lp_base = base.log_softmax(-1)
        for f in FORMATS:
            lg, _ = path_logits(model, mc, f, prompt, path, greedy=False)
            lp = lg.log_softmax(-1)
            agree[f].append(float((lg.argmax(-1) == base.argmax(-1)).float().mean()))
            kl[f].append(float((lp_base.exp() * (lp_base - lp)).sum(-1).mean()))
    rows = [{"format": f, "top-1 agreement": sum(agree[f]) / len(agree[f]),
             "KL vs bf16": f"{sum(kl[f]) / len(kl[f]):.2e}"} for f in FORMATS]  # fmt: skip
    print(f"\n## teacher-forced agreement with the bf16 cache: {model_dir}")
    kind = "text windows" if text and tok_path.exists() else "random-token prompts"
    print(f"{len(inputs)} {kind} x {len(inputs[0])} tokens, {steps} decode steps each")
    print(table(rows, ["format", "top-1 agreement", "KL vs bf16"]))
    return {r["format"]: {"agreement": round(r["top-1 agreement"], 4),
                          "kl": float(r["KL vs bf16"])} for r in rows}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="5m", help="bench model size (5m, 50m) or a directory")
    ap.add_argument("--quality-model", action="append", default=[],
                    help="more checkpoints for the agreement section")  # fmt: skip
    ap.add_argument("--quality-text", help="a text file: agreement on windows of it (models "
                    "with a tokenizer.json) instead of random tokens")  # fmt: skip
    args = ap.parse_args()
    # One thread unless told otherwise: on a shared 2-core machine, two OpenMP threads wait on
    # each other's time slices and the figures measure the scheduler, not the code.
    os.environ.setdefault("KVSERVE_BENCH_THREADS", "1")
    threads = set_threads()
    model = bench_model(args.model) if args.model in ("5m", "50m") else args.model
    q = args.quick
    t0 = time.perf_counter()
    ratio = bytes_section()
    cap, cap_strict = capacity_section(model, memory=(64 if q else 256) * 2**20)
    step = step_time_section(
        model, batch=4 if q else 8, context=512 if q else 3072, steps=8 if q else 64
    )
    tput, tok_s = throughput_section(
        model, n=6 if q else 16, prompt=512 if q else 3072, out=16 if q else 96, bf16_seqs=2.5
    )
    codec_error_section(model, 256 if q else 1024)
    text = Path(args.quality_text).read_text() if args.quality_text else None
    quality = {}
    for qm in [model, *args.quality_model]:
        quality[qm] = agreement_section(
            qm, 2 if q else 4, 256 if q else 1024, 16 if q else 64, text=text
        )
    total = time.perf_counter() - t0
    print(f"\n{threads} threads, float32 compute, block size 16; total {total:.0f} s")
    emit(
        {
            "bytes_per_token_ratio": ratio,
            "capacity_ratio": cap,
            "capacity_ratio_incl_residual": cap_strict,
            "step_time_ratio": step,
            "tok_s": tput,
            "agreement": {m: {f: v["agreement"] for f, v in r.items()} for m, r in quality.items()},
            "tok_s_abs": {f: round(v, 1) for f, v in tok_s.items()},
        }
    )


if __name__ == "__main__":
    main()
