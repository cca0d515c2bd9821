"""What each KIVI design choice costs and buys on a real model, through the quality gate.

Each configuration runs the gate's full suite against one shared exact baseline with an
*emulated* KIVI cache: a dense cache whose blocks are replaced, when they go cold, by their
quantized-then-dequantized values, so every variant sees exactly the error its quantizer makes
without writing a storage format for each. Knobs (KIVI paper: R = 128 recent tokens in full
precision, keys per channel in groups of 32 tokens, values per token in groups of 32 channels):

- ``bits`` 2 or 4;
- ``block`` the key group along tokens (the engine's block size: keys are quantized per channel
  over one block);
- ``group`` the value group along channels (per token);
- ``rotate`` keys in the Hadamard-rotated basis (what the engine's kivi formats do);
- ``residual`` the most recent tokens of each sequence kept in full precision (the engine keeps
  only the partial tail block: 0 here);
- ``sinks`` the first tokens of each sequence kept in full precision (whole blocks);
- ``outliers`` per token, the values of that many largest-magnitude channels kept exactly
  (fp16 plus a channel index: 3 bytes each).

"bytes" is the cost per token of a 4,096-token sequence against bf16, metadata, the full-
precision residual, sinks and outliers included. The emulation quantizes a block as soon as it
leaves the window (the engine batches that, which only ever helps), so for the engine's own
configuration it is a slight pessimist; `kvserve quality --kv-cache-dtype kivi2` gives the
engine's figure beside it.

    .venv/bin/python -m benchmarks.kivi_tradeoffs --model smollm2 [--configs NAME,...] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import emit, set_threads, table
from kvserve.kv import codecs
from kvserve.kv.kivi_storage import hadamard
from kvserve.kv.storage import KVStorage, KVStorageWrapper
from kvserve.sched.output import SchedulerOutput


@dataclass(frozen=True, slots=True)
class KiviConfig:
    bits: int = 2
    block: int = 16
    group: int = 64
    rotate: bool = True
    residual: int = 0
    sinks: int = 0
    outliers: int = 0

    @property
    def name(self) -> str:
        parts = [f"kivi{self.bits}", f"b{self.block}", f"g{self.group}"]
        parts += ["rot"] if self.rotate else []
        parts += [f"R{self.residual}"] if self.residual else []
        parts += [f"S{self.sinks}"] if self.sinks else []
        parts += [f"o{self.outliers}"] if self.outliers else []
        return "-".join(parts)

    def bytes_ratio(self, head_dim: int, context: int = 4096, full_bytes: int = 2) -> float:
        """Bytes per token of a ``context``-token sequence over bf16's (per KV head and layer
        both sides, so the figure holds for any model with this head size)."""
        d = head_dim
        group = min(self.group, d)
        k = d * self.bits / 8 + (2 * d + 12) / self.block
        v = d * self.bits / 8 + 4 * d / group + 3 * self.outliers
        full = 2 * d * full_bytes
        kept = min(context, self.sinks + max(self.residual, self.block / 2))  # tail: half a block
        return ((context - kept) * (k + v) + kept * full) / (context * full)


CONFIGS: dict[str, KiviConfig] = {
    c.name: c
    for c in [
        KiviConfig(2),  # the engine's kivi2
        KiviConfig(2, rotate=False),
        KiviConfig(2, block=32),
        KiviConfig(2, group=32),
        KiviConfig(2, residual=64),
        KiviConfig(2, residual=128),
        KiviConfig(2, sinks=16),
        KiviConfig(2, outliers=2),
        KiviConfig(2, group=32, residual=64, sinks=16),
        KiviConfig(4),  # the engine's kivi4
        KiviConfig(4, block=32),
        KiviConfig(4, rotate=False),
        KiviConfig(4, residual=64, sinks=16),
    ]
}


class KiviEmulation(KVStorageWrapper):
    """A dense storage whose full blocks, once outside the recent window and past the sink
    blocks of a sequence that holds them, are replaced by their KIVI round trip. Attention
    backends read a wrapper only through ``gather`` (no fused kernel): as for the real KIVI
    format, a prefill chunk then attends to its own tokens' fresh K/V and reads only the
    context before it through the cache."""

    def __init__(self, inner: KVStorage, cfg: KiviConfig) -> None:
        super().__init__(inner)
        if inner.block_size != cfg.block:
            raise ValueError(f"block: the engine's block size is {inner.block_size}")
        self.cfg = cfg
        self.rotation = hadamard(inner.head_dim) if cfg.rotate else None
        self.done = np.zeros(inner.num_rows, dtype=bool)
        self.todo = torch.zeros(0, dtype=torch.long)

    def note_step(self, so: SchedulerOutput) -> None:
        """Which blocks go cold this step (read before the forward pass)."""
        for blocks in so.kv_ops.new_blocks.values():
            self.done[blocks] = False  # a block handed out again holds new content
        bs, cfg, todo = self.block_size, self.cfg, []
        first = math.ceil(cfg.sinks / bs)
        for seq in so.seqs:
            end = seq.num_cached + seq.num_tokens
            for b in seq.block_ids[first : max(0, (end - cfg.residual) // bs)]:
                if not self.done[b]:
                    self.done[b] = True
                    todo.append(b)
        self.todo = torch.tensor(todo, dtype=torch.long)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:  # fmt: skip
        self.inner.write(layer, slot_mapping, k, v)
        if not self.todo.numel():
            return
        kc, vc = self.inner.k[layer], self.inner.v[layer]  # [blocks, kvh, bs, d]
        kc[self.todo] = self._keys(kc[self.todo].float()).to(kc.dtype)
        vc[self.todo] = self._values(vc[self.todo].float()).to(vc.dtype)

    def _keys(self, x: torch.Tensor) -> torch.Tensor:
        if self.rotation is not None:
            x = x @ self.rotation
        x = codecs.kivi_dequantize_keys(*codecs.kivi_quantize_keys(x, self.cfg.bits),
                                        bits=self.cfg.bits)  # fmt: skip
        return x @ self.rotation.T if self.rotation is not None else x

    def _values(self, x: torch.Tensor) -> torch.Tensor:
        group = min(self.cfg.group, x.shape[-1])
        o = self.cfg.outliers
        if o:
            idx = x.abs().topk(o, dim=-1).indices
            exact = x.gather(-1, idx)
            filler = x.mean(-1, keepdim=True).expand_as(exact)
            x = x.scatter(-1, idx, filler)  # outliers leave the groups' ranges
        y = codecs.kivi_dequantize_values(*codecs.kivi_quantize_values(x, self.cfg.bits, group),
                                          bits=self.cfg.bits)  # fmt: skip
        return y.scatter(-1, idx, exact) if o else y


def say(message: str) -> None:
    print(f"[kivi] {message}", file=sys.stderr, flush=True)


def _kept(row: dict[str, Any]) -> float:
    """Share of the baseline's right answers the candidate keeps."""
    base_hits = round(row["baseline"] * row["n"])
    return (base_hits - row["lost"]) / base_hits if base_hits else float("nan")


def install(cfg: KiviConfig):  # noqa: ANN201 - a candidate_setup for run_gates
    def setup(llm: Any) -> None:
        engine = llm.engine
        engine.replace_storage(lambda st: KiviEmulation(st, cfg))
        emu, run = (
            engine.executor.driver_worker.storage,
            engine.executor.driver_worker.runner.execute_model,
        )

        def execute(so: SchedulerOutput):  # noqa: ANN202
            emu.note_step(so)
            return run(so)

        engine.executor.driver_worker.runner.execute_model = execute

    return setup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--configs", default=None, help=f"comma list of: {', '.join(CONFIGS)}")
    ap.add_argument("--quick", action="store_true", help="the gate's quick suite (smoke test)")
    ap.add_argument("--out", type=Path, default=Path("reports/kivi-tradeoffs"))
    args = ap.parse_args()
    from kvserve.model.resolve import resolve_model
    from kvserve.quality.gate import run_gates
    from kvserve.quality.suite import SuiteSpec

    names = args.configs.split(",") if args.configs else list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {', '.join(unknown)}; known: {', '.join(CONFIGS)}")
    threads = set_threads()
    model = resolve_model(args.model)
    spec = SuiteSpec.quick() if args.quick else SuiteSpec.default()
    by_block: dict[int, list[KiviConfig]] = {}
    for n in names:
        by_block.setdefault(CONFIGS[n].block, []).append(CONFIGS[n])
    from kvserve.config import ModelConfig

    head_dim = ModelConfig.from_pretrained(model).head_dim
    rows, out = [], {}
    for block, cfgs in by_block.items():  # one baseline per block size (the pool's geometry)
        kw = dict(model=model, dtype=args.dtype, block_size=block, max_num_batched_tokens=64,
                  max_num_seqs=16)  # fmt: skip
        setups = [install(c) for c in cfgs]
        reports = run_gates(kw, [{}] * len(cfgs), spec, candidate_setup=setups,
                            labels=[c.name for c in cfgs], log=say)  # fmt: skip
        for cfg, rep in zip(cfgs, reports, strict=True):
            m = {r["key"]: r for r in rep["metrics"]}
            kept = {key: _kept(r) for key, r in m.items() if key.startswith("recall_")}

            row = {"config": cfg.name, "bytes vs bf16": cfg.bytes_ratio(head_dim),
                   "needles kept": kept["recall_needle"],
                   "depth 0-10 kept": kept["recall_needle_depth_0_10"],
                   "multi-needle kept": kept["recall_multi_needle"],
                   "multi-turn kept": kept["recall_multi_turn"],
                   "ppl +": m["perplexity"]["delta"],
                   "teacher-forced agree": m["teacher_forced_agreement"]["candidate"],
                   "gate": rep["verdict"]}  # fmt: skip
            rows.append(row)
            out[cfg.name] = {**row, "config": asdict(cfg), "metrics": rep["metrics"]}
    print(f"{model}, {args.dtype}, {threads} threads, suite {'quick' if args.quick else 'default'}")
    print(table(rows, list(rows[0])))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kivi_tradeoffs.json").write_text(json.dumps(out, indent=1, default=str))
    emit({r["config"]: {k: r[k] for k in ("bytes vs bf16", "needles kept", "ppl +", "gate")}
          for r in rows})  # fmt: skip


if __name__ == "__main__":
    main()
