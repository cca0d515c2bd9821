"""Shared pieces of the benchmark scripts: the random Llamas, seeded prompts, timing helpers,
and the one-JSON-line summary every script ends with."""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvserve import envs
from kvserve.config import user_cache_dir
from kvserve.sim.serving import wait_ready  # noqa: F401 - the benchmarks' name for it

REPO = Path(__file__).resolve().parent.parent
MODEL_CACHE = user_cache_dir() / "bench-models"

# ~5 M, ~50 M and ~135 M parameter random Llamas (GQA): a tiny model whose steps are all
# overhead, a small one, and one of SmolLM2-135M's shape.
MODELS: dict[str, dict[str, Any]] = {
    "5m": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4,
               num_heads=4, num_kv_heads=2),
    "50m": dict(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_layers=10,
                num_heads=8, num_kv_heads=4),
    # SmolLM2-135M's shape with random weights: the real model's speed where its 98 MB GGUF
    # cannot go (a device machine that takes 64 MiB of files; no downloads at run time).
    "135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                 num_heads=9, num_kv_heads=3, tie_word_embeddings=True, rope_theta=100000.0),
}  # fmt: skip


def bench_model(size: str) -> str:
    """Path of the random checkpoint ``size`` (built once, deterministically, then cached),
    or of any other model the engine knows by name or path (``smollm2``, ``kvserve-ref``, a
    directory or a .gguf file)."""
    from kvserve.model.synthetic import make_random_checkpoint

    if size not in MODELS:
        from kvserve.model.resolve import resolve_model

        return resolve_model(size)
    path = MODEL_CACHE / size
    if not (path / "model.safetensors").exists():
        make_random_checkpoint(
            path, seed=0, max_position_embeddings=8192, init_std=0.05, **MODELS[size]
        )
    return str(path)


def vocab_size(size: str) -> int:
    """The vocabulary of a benchmark model (random sizes without reading the checkpoint)."""
    if size in MODELS:
        return MODELS[size]["vocab_size"]
    from kvserve.config import ModelConfig

    return ModelConfig.from_pretrained(bench_model(size)).vocab_size


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def set_threads() -> int:
    n = envs.KVSERVE_BENCH_THREADS or min(2, os.cpu_count() or 1)
    torch.set_num_threads(n)
    return n


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def drain(engine: Any, prompts: list[list[int]], params: Any) -> dict[str, float]:
    """Queue every prompt on an ``LLMEngine`` and step until all finish: wall seconds, the
    most requests running at once, preemptions."""
    for p in prompts:
        engine.add_request(None, p, params)
    t0, peak = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.stats().num_running)
    wall = time.perf_counter() - t0
    return {"wall s": wall, "peak running": peak,
            "preemptions": engine.stats().num_preemptions}  # fmt: skip


def copy_bandwidth(nbytes: int = 256 * 2**20, reps: int = 5, device: str = "cpu") -> float:
    """Measured memory copy bandwidth in bytes/s (read + write counted once, as a stream) on
    ``device``."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / median(times)


def sync(device: str | torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU, whose work is never queued), so
    that a wall-clock timer around it measures the work, not its launch."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def emit(summary: dict[str, Any]) -> None:
    """The last line of every benchmark: one JSON object of headline figures."""
    sys.stdout.flush()
    print(json.dumps(summary, sort_keys=True))


def run_json_child(
    argv: list[str], env: dict[str, str], timeout: float = 3600
) -> dict[str, Any] | None:
    """Run a benchmark's child process from the repository root and return the last JSON
    object it printed (None, with its stderr's tail printed, when it failed or printed none)."""
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=timeout)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        print(f"{argv[1:4]} failed (rc {proc.returncode}): {proc.stderr[-2000:]}", flush=True)
        return None
    return json.loads(lines[-1])
