"""``kvserve quality``'s core: run the suite on the exact baseline and on a candidate KV
configuration of the same model, and judge the candidate against thresholds.

Why the two runs are made identical except for the KV format: a gate that compares runs with
different batch compositions measures scheduling noise as much as the format. So both engines
get the same scheduler settings and the *same number of KV blocks* (the candidate's pool is
sized by block count, not bytes, even when a format would fit more blocks in the memory), and
both see the same requests in the same order. With the exact format on both sides, every step
computes the same tensors and the gate reports agreement 100 % and KL 0 exactly.

The baseline is the same engine configuration with ``kv_cache_dtype="auto"`` (the model dtype)
and no lossy option. Prefix caching is lossless, so it stays as configured.

Test-only or experimental configurations plug in through ``candidate_setup``: a callable that
receives the candidate :class:`kvserve.LLM` right after construction, before any request.
:func:`wrap_kv_storage` is the supported way for such a callable to replace the KV storage.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvserve.config import ConfigError, EngineConfig, ModelConfig
from kvserve.config_fields import default_of
from kvserve.quality.metrics import (
    LogitComparison,
    RunResult,
    min_cache_read_share,
    recall_grid,
    recall_groups,
    run_suite,
)
from kvserve.quality.stats import mcnemar_p, paired_drop_interval
from kvserve.quality.suite import Suite, SuiteSpec, build_suite
from kvserve.quality.thresholds import Thresholds

CandidateSetup = Callable[[Any], None]
LOSSY_KWARGS = {"kv_cache_dtype": "auto", "calculate_kv_scales": False, "kv_retention": None}
RECALL_LABELS = {
    "needle": "needle recall",
    "needle_depth_0_10": "needle recall, depth 0-10 %",
    "multi_needle": "multi-needle recall",
    "multi_turn": "multi-turn recall",
    "variable_tracking": "variable tracking recall",
}


def wrap_kv_storage(llm: Any, wrap: Callable[[Any], Any]) -> None:
    """Replace ``llm``'s KV storage with ``wrap(storage)`` (e.g. a test-only corrupting
    wrapper). Call it from a ``candidate_setup`` before any request runs: the engine and its
    runner hold the same storage object and must keep doing so."""
    llm.engine.replace_storage(wrap)


def _pool_blocks(kwargs: dict[str, Any], suite: Suite) -> int:
    """Blocks for every request the scheduler may hold at once, so the gate never preempts."""
    bs = kwargs.get("block_size", default_of(EngineConfig, "block_size"))
    need = sorted((-(-n // bs) for n in suite.total_lens()), reverse=True)
    return sum(need[: kwargs.get("max_num_seqs", default_of(EngineConfig, "max_num_seqs"))]) + 1


def _max_model_len(kwargs: dict[str, Any]) -> int:
    mc = ModelConfig.from_pretrained(Path(kwargs["model"]))
    return kwargs.get("max_model_len") or mc.max_position_embeddings


def _load_tokenizer(kwargs: dict[str, Any]) -> Any:
    from kvserve.model.tokenizer import Tokenizer

    tok_dir = Path(kwargs.get("tokenizer") or kwargs["model"])
    if not (tok_dir / "tokenizer.json").exists():
        raise ConfigError(
            f"tokenizer: the quality gate renders text tasks and needs {tok_dir}/tokenizer.json"
        )
    return Tokenizer(tok_dir)


def describe(kwargs: dict[str, Any]) -> str:
    """A short label of a KV configuration, for tables and file names."""
    label = kwargs.get("kv_cache_dtype", "auto")
    if kwargs.get("calculate_kv_scales"):
        label += "+calc-scales"
    if kwargs.get("kv_retention"):
        label += f"+{kwargs['kv_retention']}"
    return label


def run_gate(
    engine_kwargs: dict[str, Any],
    spec: SuiteSpec | None = None,
    thresholds: Thresholds | None = None,
    candidate_setup: CandidateSetup | None = None,
    label: str | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run baseline and candidate (``engine_kwargs`` as for :class:`kvserve.LLM`) and return
    the report: every metric with both values, its threshold and PASS/FAIL, the recall grids,
    timings and the exact settings. ``report["passed"]`` is the verdict."""
    (report,) = run_gates(engine_kwargs, [{}], spec, thresholds, candidate_setup, [label], log)
    return report


def run_gates(
    engine_kwargs: dict[str, Any],
    candidates: list[dict[str, Any]],
    spec: SuiteSpec | None = None,
    thresholds: Thresholds | None = None,
    candidate_setup: CandidateSetup | list[CandidateSetup | None] | None = None,
    labels: list[str | None] | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One baseline run, then each candidate (``engine_kwargs`` updated by one dict of
    ``candidates``, e.g. ``{"kv_cache_dtype": "int8"}``) judged against it: one report each,
    as :func:`run_gate` returns. Gating several formats this way runs the baseline once.
    ``candidate_setup`` is one callable for every candidate or a list, one per candidate."""
    from kvserve import LLM

    spec = spec or SuiteSpec.default()
    thresholds = thresholds or Thresholds()
    labels = labels or [None] * len(candidates)
    say = log or (lambda _msg: None)
    base_kw = {**engine_kwargs, **LOSSY_KWARGS}
    tok = _load_tokenizer(engine_kwargs)
    suite = build_suite(tok, spec, _max_model_len(engine_kwargs))
    if base_kw.get("num_gpu_blocks") is None and base_kw.get("kv_cache_memory") is None:
        base_kw["num_gpu_blocks"] = _pool_blocks(base_kw, suite)
    n_tok = sum(len(i.prompt_ids) for i in suite.items) + sum(map(len, suite.passages))
    say(f"suite: {len(suite.items)} generation prompts + {len(suite.passages)} passages, "
        f"{n_tok} prompt tokens per run")  # fmt: skip

    say("baseline run ...")
    base_llm = LLM(**base_kw)
    num_blocks = base_llm.engine.num_blocks
    base = run_suite(base_llm, suite, keep_logits=True)
    base_fmt = base_llm.engine.kv_cache_dtype
    del base_llm
    say(f"baseline: {base.seconds:.1f}s, {base.steps} steps")

    reports = []
    setups = (
        candidate_setup
        if isinstance(candidate_setup, list)
        else [candidate_setup] * len(candidates)
    )
    for over, label, setup in zip(candidates, labels, setups, strict=True):
        # The candidate gets the baseline's block count, whatever memory its format allows.
        cand_kw = {**engine_kwargs, **over, "num_gpu_blocks": num_blocks, "kv_cache_memory": None}
        say(f"candidate run: {describe(cand_kw)} ...")
        cand_llm = LLM(**cand_kw)
        if setup is not None:
            setup(cand_llm)
        cmp = LogitComparison()
        cand = run_suite(
            cand_llm, suite, on_logits=lambda n, lg, cmp=cmp: cmp.add(base.logits[n], lg)
        )
        cand_fmt = cand_llm.engine.kv_cache_dtype
        chunk = cand_llm.engine.config.scheduler.max_num_batched_tokens
        chunked = cand_llm.engine.config.scheduler.enable_chunked_prefill
        del cand_llm
        say(f"candidate: {cand.seconds:.1f}s, {cand.steps} steps")
        metrics = _judge(suite, base, cand, cmp, thresholds)
        same = sum(a == b for a, b in zip(base.texts, cand.texts, strict=True))
        reports.append({
            "passed": all(m["passed"] for m in metrics),
            "model": str(cand_kw["model"]),
            "label": label or describe(cand_kw) + ("+setup" if setup else ""),
            "baseline": {"kv_format": base_fmt, "engine": _jsonable(base_kw)},
            "candidate": {"kv_format": cand_fmt, "engine": _jsonable(cand_kw)},
            "metrics": metrics,
            "answers_identical": same / len(base.texts) if base.texts else None,
            "grid": {
                "baseline": recall_grid(suite, base.hits),
                "candidate": recall_grid(suite, cand.hits),
            },
            "suite": {
                **spec.to_dict(),
                "generation_prompts": len(suite.items),
                "prompt_tokens_per_run": n_tok,
                "chat_template": suite.chat_template,
                "skipped": suite.skipped,
            },
            "cache_reads": {
                "prefill_chunk_tokens": chunk,
                "chunked_prefill": chunked,
                "min_share_of_prompt_positions": min_cache_read_share(suite, chunk)
                if chunked else 0.0,
            },
            "thresholds": asdict(thresholds),
            "seconds": {"baseline": round(base.seconds, 2), "candidate": round(cand.seconds, 2)},
            "steps": {"baseline": base.steps, "candidate": cand.steps},
        })  # fmt: skip
    return reports


def _judge(
    suite: Suite, base: RunResult, cand: RunResult, cmp: LogitComparison, th: Thresholds
) -> list[dict[str, Any]]:
    """One row per metric. A NaN never passes (comparisons with NaN are False)."""
    rows: list[dict[str, Any]] = []
    for key, idx in recall_groups(suite).items():
        hits = [(base.hits[i], cand.hits[i]) for i in idx]
        rows.append(judge_recall(f"recall_{key}", RECALL_LABELS[key], hits, th))
    bp, cp = base.perplexity, cand.perplexity
    inc = cp / bp - 1.0 if bp > 0 else float("nan")
    rows.append(
        _row("perplexity", "held-out perplexity", "ppl", bp, cp, inc, base.ppl_tokens,
             f"increase <= {th.max_ppl_increase:.1%}", inc <= th.max_ppl_increase)
    )  # fmt: skip
    agr = cmp.agreement
    rows.append(
        _row("top1_agreement", "next-token top-1 agreement", "share", 1.0, agr, None,
             cmp.positions, f">= {th.min_agreement:.1%}", agr >= th.min_agreement)
    )  # fmt: skip
    kl = cmp.mean_kl
    rows.append(
        _row("mean_kl", "mean KL(baseline||candidate), nats", "kl", 0.0, kl, None,
             cmp.positions, f"<= {th.max_kl:g}", kl <= th.max_kl)
    )  # fmt: skip
    rows[-1]["max_kl"] = cmp.kl_max
    return rows


def judge_recall(
    key: str, label: str, hits: list[tuple[bool, bool]], th: Thresholds
) -> dict[str, Any]:
    """One recall row from (baseline hit, candidate hit) per prompt. A drop fails only when it
    is both over the threshold and more than sampling noise (McNemar's exact test on the
    prompts lost and gained, one-sided, at ``th.alpha``)."""
    n = len(hits)
    b = sum(x for x, _ in hits) / n
    c = sum(y for _, y in hits) / n
    lost = sum(x and not y for x, y in hits)
    gained = sum(y and not x for x, y in hits)
    p = mcnemar_p(lost, gained)
    ok = b - c <= th.max_recall_drop + 1e-12 or p >= th.alpha
    row = _row(key, label, "recall", b, c, c - b, n,
               f"drop <= {th.max_recall_drop * 100:.1f} pt or p >= {th.alpha:g}", ok)  # fmt: skip
    lo, hi = paired_drop_interval(lost, gained, n, 1 - th.alpha)
    row.update(lost=lost, gained=gained, p_value=p, drop_interval=[lo, hi])
    return row


def _row(
    key: str,
    label: str,
    kind: str,
    base: float,
    cand: float,
    delta: float | None,
    n: int,
    threshold: str,
    passed: bool,
) -> dict[str, Any]:
    return {
        "key": key,
        "label": label,
        "kind": kind,
        "baseline": base,
        "candidate": cand,
        "delta": delta,
        "n": n,
        "threshold": threshold,
        "passed": bool(passed) and not math.isnan(cand),
    }


def _jsonable(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, int | float | str | bool | None) else str(v)
            for k, v in kwargs.items()}  # fmt: skip
