"""``kvserve quality``'s core: run the suite on the exact baseline and on a candidate KV
configuration of the same model, and judge the candidate metric by metric: PASS, FAIL or
INCONCLUSIVE by non-inferiority (:mod:`kvserve.quality.stats`); PASS overall only if every
metric passes, FAIL if any fails.

Why the two runs are made identical except for the KV format: a gate that compares runs with
different batch compositions measures scheduling noise as much as the format. So both engines
get the same scheduler settings and the *same number of KV blocks* (the candidate's pool is
sized by block count, not bytes, even when a format would fit more blocks in the memory), and
both see the same requests in the same order. With the exact format on both sides, every step
computes the same tensors and the gate reports agreement 100 % and KL 0 exactly. That is why
a candidate with no lossy option is refused: it would pass by construction and prove nothing.

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
from kvserve.quality.stats import (
    EXIT_CODES,
    INCONCLUSIVE,
    MIN_PASSAGES,
    Stat,
    bootstrap,
    decide,
    newcombe_loss,
    overall,
    passages_needed,
    prompts_needed,
)
from kvserve.quality.suite import Suite, SuiteSpec, build_suite, metric_task
from kvserve.quality.thresholds import Thresholds

CandidateSetup = Callable[[Any], None]
LOSSY_KWARGS = {"kv_cache_dtype": "auto", "calculate_kv_scales": False, "kv_retention": None}
RECALL_LABELS = {
    "needle": "needle recall",
    "needle_depth_0_10": "needle recall, depth 0-10 %",
    "multi_needle": "multi-needle recall",
    "multi_turn": "multi-turn recall",
    "variable_tracking": "variable tracking recall",
    "instruction": "instruction following",
}
LOSSY_OPTIONS = ("--kv-cache-dtype", "--kv-retention", "--calculate-kv-scales", "--formats",
                 "--retentions")  # fmt: skip


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


def is_lossy(kwargs: dict[str, Any]) -> bool:
    """Whether engine kwargs ask for anything the baseline does not have."""
    return any(kwargs.get(k, v) not in (v, None) for k, v in LOSSY_KWARGS.items())


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
    the report: every metric with both values, its bounds, margin and verdict, the recall
    grids, timings and the exact settings. ``report["verdict"]`` is PASS, FAIL or
    INCONCLUSIVE; ``report["needed_prompts"]`` the ``--prompts`` that would decide an
    INCONCLUSIVE one at the observed rates."""
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
    on_report: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One baseline run, then each candidate (``engine_kwargs`` updated by one dict of
    ``candidates``, e.g. ``{"kv_cache_dtype": "int8"}``) judged against it: one report each,
    as :func:`run_gate` returns. Gating several formats this way runs the baseline once.
    ``candidate_setup`` is one callable for every candidate or a list, one per candidate.
    A candidate with no lossy option and no setup is the baseline itself: refused.
    ``on_report`` gets each report as soon as its candidate is judged: a large suite takes
    an hour per candidate, and a run stopped later should not lose the ones already done."""
    from kvserve import LLM

    spec = spec or SuiteSpec.default()
    thresholds = thresholds or Thresholds()
    labels = labels or [None] * len(candidates)
    setups = (
        candidate_setup
        if isinstance(candidate_setup, list)
        else [candidate_setup] * len(candidates)
    )
    for over, setup in zip(candidates, setups, strict=True):
        if setup is None and not is_lossy({**engine_kwargs, **over}):
            raise ConfigError(
                "quality: nothing to compare: the candidate is the exact baseline itself, so "
                "it would pass by construction; give a lossy option: " + ", ".join(LOSSY_OPTIONS)
            )
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
    base = run_suite(base_llm, suite, keep_logits=True, progress=say, label="baseline")
    base_fmt = base_llm.engine.kv_cache_dtype
    del base_llm
    say(f"baseline: {base.seconds:.1f}s, {base.steps} steps")

    reports = []
    for over, label, setup in zip(candidates, labels, setups, strict=True):
        # The candidate gets the baseline's block count, whatever memory its format allows.
        cand_kw = {**engine_kwargs, **over, "num_gpu_blocks": num_blocks, "kv_cache_memory": None}
        say(f"candidate run: {describe(cand_kw)} ...")
        cand_llm = LLM(**cand_kw)
        if setup is not None:
            setup(cand_llm)
        cmp = LogitComparison()
        cand = run_suite(
            cand_llm,
            suite,
            on_logits=lambda n, lg, cmp=cmp: cmp.add(n, base.logits[n], lg),
            progress=say,
            label="candidate",
        )
        cand_fmt = cand_llm.engine.kv_cache_dtype
        chunk = cand_llm.engine.config.scheduler.max_num_batched_tokens
        chunked = cand_llm.engine.config.scheduler.enable_chunked_prefill
        del cand_llm
        say(f"candidate: {cand.seconds:.1f}s, {cand.steps} steps")
        metrics = _judge(suite, base, cand, cmp, thresholds)
        verdict = overall([m["verdict"] for m in metrics])
        same = sum(a == b for a, b in zip(base.texts, cand.texts, strict=True))
        reports.append({
            "verdict": verdict,
            "exit_code": EXIT_CODES[verdict],
            "needed_prompts": needed_prompts(metrics, spec) if verdict == INCONCLUSIVE else None,
            "needed_by_task": needed_by_task(metrics, spec) if verdict == INCONCLUSIVE else None,
            "model": str(cand_kw["model"]),
            "label": label or describe(cand_kw) + ("+setup" if setup else ""),
            "baseline": {"kv_format": base_fmt, "engine": _jsonable(base_kw)},
            "candidate": {"kv_format": cand_fmt, "engine": _jsonable(cand_kw)},
            "metrics": metrics,
            "greedy_answers_identical": same / len(base.texts) if base.texts else None,
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
        if on_report is not None:
            on_report(reports[-1])
    return reports


def _judge(
    suite: Suite, base: RunResult, cand: RunResult, cmp: LogitComparison, th: Thresholds
) -> list[dict[str, Any]]:
    """One row per metric, each with its bounds, its verdict and, when INCONCLUSIVE, the size
    that would decide it."""
    rows: list[dict[str, Any]] = []
    for key, idx in recall_groups(suite).items():
        hits = [(base.hits[i], cand.hits[i]) for i in idx]
        rows.append(judge_recall(f"recall_{key}", RECALL_LABELS[key], hits, th))
    if not suite.passages:  # --tasks left them out: no perplexity, agreement or KL rows
        return rows
    units = [
        (base.nll[n], cand.nll[n], base.ppl_tokens[n], cmp.agree.get(n, 0),
         cmp.positions.get(n, 0), cmp.kl_sum.get(n, 0.0))
        for n in range(len(suite.passages))
    ]  # fmt: skip
    bp, cp = base.perplexity, cand.perplexity
    rows.append(judge_passages(
        "perplexity", "held-out perplexity (relative increase)", "ppl", units,
        lambda s: math.exp((s[1] - s[0]) / s[2]) - 1 if s[2] else math.nan,
        th.max_ppl_increase, th, values=(bp, cp, cp / bp - 1 if bp > 0 else math.nan),
        rule=f"upper bound <= +{th.max_ppl_increase:.1%}",
    ))  # fmt: skip
    agr = cmp.agreement
    row = judge_passages(
        "teacher_forced_agreement", "teacher-forced next-token agreement", "share", units,
        lambda s: 1 - s[3] / s[4] if s[4] else math.nan, 1 - th.min_agreement, th,
        values=(1.0, agr, agr - 1), rule=f"lower bound >= {th.min_agreement:.1%}",
    )  # fmt: skip
    row["interval"] = [1 - row["interval"][1], 1 - row["interval"][0]]  # of the agreement
    rows.append(row)
    kl = cmp.mean_kl
    rows.append(judge_passages(
        "mean_kl", "mean KL(baseline||candidate), nats", "kl", units,
        lambda s: s[5] / s[4] if s[4] else math.nan, th.max_kl, th, values=(0.0, kl, kl),
        rule=f"upper bound <= {th.max_kl:g}",
    ))  # fmt: skip
    rows[-1]["max_kl"] = cmp.kl_max
    for r in rows:
        r["positions"] = cmp.total_positions if r["unit"] == "passages" else None
    return rows


def judge_recall(
    key: str, label: str, hits: list[tuple[bool, bool]], th: Thresholds
) -> dict[str, Any]:
    """One recall row from (baseline hit, candidate hit) per prompt: the loss (baseline minus
    candidate share) with Newcombe's paired bounds, judged against ``th.max_recall_drop``."""
    n = len(hits)
    both = sum(x and y for x, y in hits)
    lost = sum(x and not y for x, y in hits)
    gained = sum(y and not x for x, y in hits)
    neither = n - both - lost - gained
    lo, hi = newcombe_loss(both, lost, gained, neither, th.confidence)
    verdict = decide(lo, hi, th.max_recall_drop)
    needed = None
    if verdict == INCONCLUSIVE:
        needed = prompts_needed(both, lost, gained, neither, th.max_recall_drop, th.confidence)
    b, c = (both + lost) / n, (both + gained) / n
    return {
        "key": key, "label": label, "kind": "recall", "unit": "prompts", "n": n,
        "baseline": b, "candidate": c, "delta": c - b, "loss": b - c,
        "interval": [lo, hi], "margin": th.max_recall_drop,
        "rule": f"loss upper bound <= {th.max_recall_drop * 100:g} pt",
        "verdict": verdict, "needed": needed, "lost": lost, "gained": gained,
    }  # fmt: skip


def judge_passages(
    key: str,
    label: str,
    kind: str,
    units: list[tuple[float, ...]],
    loss: Stat,
    margin: float,
    th: Thresholds,
    values: tuple[float, float, float],
    rule: str,
) -> dict[str, Any]:
    """One row read over passages: ``loss(column sums)`` with percentile-bootstrap bounds
    (resampling whole passages). Fewer than ``MIN_PASSAGES`` passages decide nothing."""
    n = len(units)
    est = loss([sum(col) for col in zip(*units, strict=True)]) if units else math.nan
    lo, hi = bootstrap(units, loss, th.confidence)
    verdict = decide(lo, hi, margin)
    if n < MIN_PASSAGES:
        verdict = INCONCLUSIVE
    needed = None
    if verdict == INCONCLUSIVE:
        needed = passages_needed(est, lo, hi, n, margin) if n else MIN_PASSAGES
    base, cand, delta = values
    return {
        "key": key, "label": label, "kind": kind, "unit": "passages", "n": n,
        "baseline": base, "candidate": cand, "delta": delta, "loss": est,
        "interval": [lo, hi], "margin": margin, "rule": rule,
        "verdict": verdict, "needed": needed,
    }  # fmt: skip


def _row_prompts(r: dict[str, Any], spec: SuiteSpec) -> int | None:
    """The ``--prompts`` at which row ``r`` would decide at its observed rates (its group's
    size is proportional to ``spec.prompts``); None if no size would."""
    if r["needed"] is None or not r["n"]:
        return None
    return math.ceil(r["needed"] * spec.prompts / r["n"] - 1e-9)


def needed_prompts(rows: list[dict[str, Any]], spec: SuiteSpec) -> int | None:
    """The ``--prompts`` that would decide every INCONCLUSIVE row at the observed rates; None
    if some row cannot be decided."""
    needs = [_row_prompts(r, spec) for r in rows if r["verdict"] == INCONCLUSIVE]
    if None in needs:
        return None
    return max([spec.prompts, *needs])


def needed_by_task(rows: list[dict[str, Any]], spec: SuiteSpec) -> dict[str, int | None]:
    """Per task with an INCONCLUSIVE row, the ``--prompts`` that would decide it at the
    observed rates when run alone (``--tasks``); None where no size would."""
    by_task: dict[str, list[int | None]] = {}
    for r in rows:
        if r["verdict"] == INCONCLUSIVE:
            by_task.setdefault(metric_task(r["key"]), []).append(_row_prompts(r, spec))
    out: dict[str, int | None] = {}
    for task, needs in by_task.items():
        known = [n for n in needs if n is not None]
        out[task] = max(known) if len(known) == len(needs) else None
    return out


def _jsonable(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, int | float | str | bool | None) else str(v)
            for k, v in kwargs.items()}  # fmt: skip
