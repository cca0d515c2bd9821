"""StreamingLLM's table on our engine: perplexity per segment along one long stream, for the
full cache (up to the model's position limit), ``window:W`` and ``sinks:4,window:W-4`` at the
same budget of W cached tokens.

The stream is seeded natural text from the quality gate's held-out generator (the model has
not seen it), fed as one prompt in chunks of ``--chunk`` tokens; each chunk's prompt logits
give the log-probability of every next token. The runner seam keeps memory flat: a wrapper
runner reduces each chunk's ``[chunk, vocab]`` log-softmax to the target tokens' values before
the engine stores them, so a 32k-token stream never holds a 32k x vocab tensor.

    .venv/bin/python -m benchmarks.streaming --model smollm2 [--stream-tokens N] [--budget W]
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from benchmarks.common import bench_model, emit, set_threads, table, timed
from kvserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoint import setup_process
from kvserve.model.tokenizer import Tokenizer
from kvserve.quality.tasks import heldout_passages
from kvserve.sched.output import ModelRunnerOutput, SchedulerOutput
from kvserve.sched.request import SamplingParams


class TargetLogprobs:
    """A runner that returns, for prompt rows, only the log-probability of the token that
    follows each row in ``stream`` (NaN past its end)."""

    def __init__(self, inner: Any, stream: list[int]) -> None:
        self.inner = inner
        self.targets = torch.tensor(stream[1:] + [-1])

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        out = self.inner.execute_model(sched)
        for seq in sched.seqs:
            rows = out.prompt_logits.get(seq.req_id)
            if rows is None:
                continue
            t = self.targets[seq.position : seq.position + rows.shape[0]]
            vals = rows.float().gather(1, t.clamp(min=0)[:, None])[:, 0]
            out.prompt_logits[seq.req_id] = torch.where(t >= 0, vals, float("nan"))
        return out


def stream_tokens(model_dir: str, n: int, seed: int) -> list[int]:
    tok = Tokenizer(model_dir)
    ids: list[int] = []
    i = 0
    while len(ids) < n:
        (text,) = heldout_passages(1, 2048, lambda s: len(tok.encode(s)), seed=seed + i)
        ids += tok.encode(text + "\n\n", add_special_tokens=False)
        i += 1
    return ids[:n]


def run(model: str, stream: list[int], retention: str | None, chunk: int, dtype: str,
        max_model_len: int) -> list[float]:  # fmt: skip
    config = EngineConfig(
        model=model,
        dtype=dtype,
        cache=CacheConfig(kv_retention=retention, enable_prefix_caching=False),
        scheduler=SchedulerConfig(
            max_num_seqs=1, max_num_batched_tokens=chunk, max_model_len=max_model_len
        ),  # fmt: skip
    )
    engine = LLMEngine(config)
    engine.core.runner = TargetLogprobs(engine.core.runner, stream)  # the runner seam
    engine.add_request("s", stream, SamplingParams(max_tokens=1), return_prompt_logits=True)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
    assert out is not None and out.prompt_logits is not None
    return out.prompt_logits.tolist()


def segment_ppl(lps: list[float], seg: int) -> list[float]:
    out = []
    for s in range(0, len(lps), seg):
        xs = [x for x in lps[s : s + seg] if not math.isnan(x)]
        out.append(math.exp(-sum(xs) / len(xs)) if xs else float("nan"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--stream-tokens", type=int, default=None,
                    help="default: 4x the model's max_position_embeddings")  # fmt: skip
    ap.add_argument("--budget", type=int, default=1024, help="cached tokens per policy")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--segment", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens per step)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    threads = set_threads()
    setup_process()  # it builds LLMEngine itself, where LLM(...) would have done this
    model = bench_model(args.model)
    mc = ModelConfig.from_pretrained(model)
    limit = mc.max_position_embeddings
    n = args.stream_tokens or 4 * limit
    stream = stream_tokens(model, n, args.seed)
    w = args.budget
    configs: list[tuple[str, str | None, int]] = [
        ("full cache", None, min(n, limit - 1)),
        (f"window:{w}", f"window:{w}", n),
        (sinks := f"sinks:{args.sinks},window:{w - args.sinks}", sinks, n),
    ]
    curves, secs = {}, {}
    for label, spec, length in configs:
        print(f"[streaming] {label}: {length} tokens ...", flush=True)
        secs[label], lps = timed(
            lambda spec=spec, length=length: run(
                model, stream[:length], spec, args.chunk, args.dtype, length + 1
            )
        )
        curves[label] = segment_ppl(lps, args.segment)
    nseg = len(curves[configs[1][0]])
    rows = []
    for i in range(nseg):
        if i % 4 and i != nseg - 1:
            continue
        row: dict[str, Any] = {"tokens": f"{i * args.segment}-{(i + 1) * args.segment}"}
        for label, _, _ in configs:
            c = curves[label]
            row[label] = c[i] if i < len(c) else "-"
        rows.append(row)
    print(f"{model}, {args.dtype}, {threads} threads; stream {n} tokens (position limit {limit}); "
          f"budget {w} tokens; ppl per {args.segment}-token segment (every 4th)")  # fmt: skip
    print(table(rows, ["tokens", *(c[0] for c in configs)]))

    def mean_after(label: str, start: int) -> float:
        c = [x for x in curves[label][start // args.segment :] if not math.isnan(x)]
        return sum(c) / len(c) if c else float("nan")

    summary = {"stream_tokens": n, "position_limit": limit, "budget": w, "seconds": secs}
    for label, _, _ in configs:
        summary[f"mean ppl {label}"] = mean_after(label, 0)
        summary[f"mean ppl past limit {label}"] = mean_after(label, limit)
    print(table([{"policy": k[0], "mean ppl, all": mean_after(k[0], 0),
                  "mean ppl past the limit": mean_after(k[0], limit),
                  "seconds": secs[k[0]]} for k in configs],
                ["policy", "mean ppl, all", "mean ppl past the limit", "seconds"]))  # fmt: skip
    emit(summary)


if __name__ == "__main__":
    main()
