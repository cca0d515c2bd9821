"""``kvserve tune``: the configuration with the lowest cost per useful output token.

A useful token is an output token of a request that met the SLO; cost is the GPUs a
configuration occupies (replicas x TP) for the time the workload took, at ``--gpu-hour-cost``.
Each configuration is one simulation of the same seeded workload and arrivals, so they differ
only by what they change. Lossy settings (a quantized KV format, a retention policy) take part
only when a ``kvserve quality --json`` report for this model, that format and that policy says
PASS: a configuration that is cheap because it answers wrongly is not a candidate, and one
whose report is INCONCLUSIVE has not shown that it answers rightly (unless the operator
accepts that, ``--quality-accept-inconclusive``).

The search is coordinate descent from the first value of every dimension: each dimension's
values are tried with the others at the best so far, the best is adopted, and the pass repeats
until nothing changes (at most three passes). A full grid of the default space would be
thousands of simulations; this is tens, and every one tried is reported.

The space is :mod:`kvserve.sim.space`'s: what ``--search`` asks, and the default space only
when nothing is asked or ``--default-space`` says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.bench.forks import fork_map
from kvserve.bench.metrics import RequestRecord, meets_slo, summarize
from kvserve.bench.runner import LoadSpec
from kvserve.bench.workloads import BenchRequest
from kvserve.config import ConfigError, EngineConfig
from kvserve.config_fields import settings_of
from kvserve.plan.capacity import PlanError, checkpoint_bytes
from kvserve.sim.engine import SimTarget, model_dir_of
from kvserve.sim.simulate import simulate_load
from kvserve.sim.space import TARGET_KEYS, show_value

DENSE = ("auto", "float32", "bfloat16", "float16")


def is_lossy(settings: dict[str, Any]) -> bool:
    return settings.get("kv_cache_dtype", "auto") not in DENSE or bool(settings.get("kv_retention"))


@dataclass(slots=True)
class QualityGate:
    """``kvserve quality`` verdicts by (KV format, retention policy). INCONCLUSIVE (the gate's
    suite could not tell) does not let a lossy setting compete unless ``accept_inconclusive``
    (``--quality-accept-inconclusive``): no evidence of harm is not evidence of none.

    Several reports for one setting combine task by task: each task's verdict is the one of
    the report that judged it on the most prompts (a group's prompts are the same at every
    size, so the larger run contains the smaller), the worst where two are as large. So a
    whole-suite report INCONCLUSIVE on one task and a ``--tasks`` run that decides that task
    make a verdict together. A setting passes only if some report ran the whole suite."""

    passed: set[tuple[str, str | None]] = field(default_factory=set)
    failed: set[tuple[str, str | None]] = field(default_factory=set)
    inconclusive: set[tuple[str, str | None]] = field(default_factory=set)
    # Settings judged only in --tasks runs and not failed there: the tasks those covered
    partial: dict[tuple[str, str | None], tuple[str, ...]] = field(default_factory=dict)
    accept_inconclusive: bool = False

    @classmethod
    def load(cls, paths: list[str], model: str, accept_inconclusive: bool = False) -> QualityGate:
        """Reports must be for ``model`` (same directory name); anything else is an error."""
        from kvserve.quality.stats import overall
        from kvserve.quality.suite import TASKS, metric_task

        gate = cls(accept_inconclusive=accept_inconclusive)
        # setting -> task -> (prompts, verdict) of the report that judged it on the most
        judged: dict[tuple[str, str | None], dict[str, tuple[float, str]]] = {}
        whole: set[tuple[str, str | None]] = set()
        for path in paths:
            p = Path(path)
            if not p.is_file():
                raise FileNotFoundError(f"quality_report: file not found: {p}")
            try:
                rep = json.loads(p.read_text())
                eng = rep["candidate"]["engine"]
                key = (str(eng.get("kv_cache_dtype") or "auto"), eng.get("kv_retention") or None)
                verdict, rep_model = rep["verdict"], str(rep["model"])
                tasks = (rep.get("suite") or {}).get("tasks") or TASKS
                # A report's rows by task (a report without rows: its verdict, on everything)
                rows: dict[str, list[tuple[float, str]]] = {}
                for m in rep.get("metrics") or []:
                    rows.setdefault(metric_task(m["key"]), []).append((m["n"], m["verdict"]))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(
                    f"quality_report: {p} is not a `kvserve quality --json` report with a "
                    f"verdict ({e}); rerun kvserve quality"
                ) from None
            if verdict not in ("PASS", "FAIL", "INCONCLUSIVE"):
                raise ValueError(
                    f"quality_report: {p}: verdict {verdict!r} is not PASS, FAIL or INCONCLUSIVE"
                )
            if Path(rep_model).name != Path(model).name:
                raise ValueError(
                    f"quality_report: {p} is for model {Path(rep_model).name!r}, but the "
                    f"tuned model is {Path(model).name!r}"
                )
            if set(tasks) >= set(TASKS):
                whole.add(key)
            best = judged.setdefault(key, {})
            for task, row in (rows or {"*": [(math.inf, verdict)]}).items():
                mine = (max(n for n, _ in row), overall([v for _, v in row]))
                if task not in best or mine[0] > best[task][0]:
                    best[task] = mine
                elif mine[0] == best[task][0]:
                    best[task] = (mine[0], overall([mine[1], best[task][1]]))
        for key, best in judged.items():
            verdict = overall([v for _, v in best.values()])
            if verdict != "FAIL" and key not in whole:  # the tasks not run were not judged
                gate.partial[key] = tuple(t for t in TASKS if t in best)
                continue
            {"PASS": gate.passed, "FAIL": gate.failed, "INCONCLUSIVE": gate.inconclusive}[
                verdict
            ].add(key)
        return gate

    def verdict(self, settings: dict[str, Any]) -> str | None:
        """None when the configuration may compete; else why not."""
        if not is_lossy(settings):
            return None
        key = (settings.get("kv_cache_dtype", "auto"), settings.get("kv_retention") or None)
        what = f"kv_cache_dtype={key[0]}" + (f", kv_retention={key[1]}" if key[1] else "")
        if key in self.failed:
            return f"quality gate FAILED for {what}"
        if key in self.passed:
            return None
        if key in self.partial:
            return (
                f"quality reports for {what} cover only {', '.join(self.partial[key])} "
                "(kvserve quality --tasks); the whole suite must have run too"
            )
        if key in self.inconclusive:
            if self.accept_inconclusive:
                return None
            return (
                f"quality gate INCONCLUSIVE for {what} (its suite could not tell; a larger "
                "`kvserve quality --prompts N`, or `--tasks` of the undecided tasks with it, "
                "decides; or --quality-accept-inconclusive)"
            )
        return f"no passing quality report for {what} (lossy; run kvserve quality --json)"


@dataclass(slots=True)
class Trial:
    settings: dict[str, Any]
    excluded: str | None = None  # why it did not compete
    summary: dict[str, Any] | None = None
    useful_tokens: int = 0
    cost_usd: float = 0.0
    gpus: int = 1

    @property
    def usd_per_million_useful(self) -> float:
        if self.excluded or not self.useful_tokens:
            return math.inf
        return self.cost_usd / self.useful_tokens * 1e6

    @property
    def attainment(self) -> float:
        return (self.summary or {}).get("goodput", {}).get("attainment") or 0.0

    @property
    def rank_key(self) -> tuple[float, float, float]:
        """Cost per useful token first; at equal cost (an open loop that every configuration
        keeps up with takes as long on each), more requests within the SLO, then lower p95
        end-to-end latency."""
        e2e = ((self.summary or {}).get("e2e_ms") or {}).get("p95") or math.inf
        return (round(self.usd_per_million_useful, 9), -self.attainment, e2e)

    def label(self, base: dict[str, Any]) -> str:
        diff = [f"{k}={show_value(v)}" for k, v in self.settings.items() if base.get(k) != v]
        return ", ".join(diff) or "baseline"


def _key(settings: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(settings.items()))


@dataclass(slots=True)
class TuneResult:
    trials: list[Trial]
    best: Trial | None
    baseline: dict[str, Any]
    slo: dict[str, float]

    @property
    def eligible(self) -> list[Trial]:
        ok = [t for t in self.trials if not t.excluded and t.summary is not None]
        return sorted(ok, key=lambda t: t.rank_key)


def tune(
    engine_kwargs: dict[str, Any],
    make_target: Callable[[dict[str, Any], int, int, str], SimTarget],
    requests: list[BenchRequest],
    load: LoadSpec,
    seed: int,
    space: dict[str, tuple[Any, ...]],
    slo: dict[str, float],
    gpu_hour_cost: float,
    gate: QualityGate,
    max_passes: int = 3,
    on_trial: Callable[[Trial], None] | None = None,
    jobs: int = 1,
) -> TuneResult:
    """Coordinate descent over ``space``; ``make_target(engine kwargs, tp, replicas, router)``.
    ``jobs`` > 1 simulates the rest of a pass's candidates at once in that many forked
    processes; the descent then reads them in its own order, so the result is the same."""
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs: must be an integer >= 1, got {jobs!r}")
    if not slo:
        raise ValueError("slo: tune needs an SLO (--slo ttft=500ms,tpot=50ms): useful tokens are "
                         "those of requests that meet it")  # fmt: skip
    if not gpu_hour_cost > 0:
        raise ValueError(f"gpu_hour_cost: must be > 0 $/GPU-hour, got {gpu_hour_cost!r}")
    if not space or any(not v for v in space.values()):
        raise ValueError("search: the search space is empty")
    seen: dict[tuple[tuple[str, Any], ...], Trial] = {}

    def simulate(settings: dict[str, Any]) -> Trial:
        trial = Trial(dict(settings))
        trial.excluded = gate.verdict(settings)
        if trial.excluded is None:
            kw = {**engine_kwargs, **{n: v for n, v in settings.items() if n not in TARGET_KEYS}}
            try:
                target = make_target(kw, settings.get("tp", 1), settings.get("replicas", 1),
                                     settings.get("router", "round_robin"))  # fmt: skip
                res, _ = simulate_load(target, requests, load, seed)
            except (ConfigError, PlanError, ValueError, NotImplementedError) as e:
                trial.excluded = f"cannot run: {e}"
            else:
                trial.gpus = target.gpus
                trial.summary = summarize(res.records, res.duration, slo, gpu_hour_cost,
                                          target.gpus)  # fmt: skip
                trial.useful_tokens = useful_tokens(res.records, slo)
                trial.cost_usd = gpu_hour_cost * target.gpus * res.duration / 3600.0
        return trial

    ahead: dict[tuple[tuple[str, Any], ...], Trial] = {}  # simulated ahead, not yet tried

    def run(settings: dict[str, Any]) -> Trial:
        k = _key(settings)
        if k not in seen:
            seen[k] = ahead.pop(k, None) or simulate(settings)
            if on_trial is not None:
                on_trial(seen[k])
        return seen[k]

    def prefetch(candidates: list[dict[str, Any]]) -> None:
        """Simulate, in parallel, the candidates the descent may try next. It tries them
        only through ``run``, in its own order, so a result is reported (and counts) only if
        the sequential search would have run it; the others are work spent ahead."""
        todo = {
            k: c
            for c in candidates
            if (k := _key(c)) not in seen and k not in ahead and gate.verdict(c) is None
        }
        if jobs < 2 or len(todo) < 2:
            return
        ahead.update(zip(todo, fork_map(simulate, list(todo.values()), jobs), strict=True))

    best_settings = {k: v[0] for k, v in space.items()}
    baseline = dict(best_settings)
    best = run(best_settings)

    def better(a: Trial, b: Trial) -> bool:
        return a.rank_key < b.rank_key

    for _ in range(max_passes):
        changed = False
        names = list(space)
        for d, name in enumerate(names):
            # The rest of the pass tries each value of each remaining dimension with the
            # others at the best so far: all of them can run at once, and stay valid until
            # the best changes (then the rest is simulated again from the new best).
            prefetch([{**best_settings, n: v} for n in names[d:] for v in space[n]])
            for v in space[name]:
                t = run({**best_settings, name: v})
                if better(t, best):
                    best, best_settings, changed = t, dict(t.settings), True
        if not changed:
            break
    trials = list(seen.values())
    winner = best if best.usd_per_million_useful < math.inf else None
    return TuneResult(trials, winner, baseline, slo)


def useful_tokens(records: list[RequestRecord], slo: dict[str, float]) -> int:
    """Output tokens of the requests that met the SLO."""
    return sum(r.output_tokens for r in records if r.success and meets_slo(r, slo))


def slo_miss(t: Trial, slo: dict[str, float]) -> str:
    """How far a configuration is from the SLO: attainment and each p95 against its bound."""
    s = t.summary or {}
    parts = [f"{t.attainment:.0%} of requests meet it"]
    for name, bound in slo.items():
        p95 = (s.get(f"{name}_ms") or {}).get("p95")
        if p95 is not None:
            parts.append(f"p95 {name} {p95:.0f} ms vs {bound * 1e3:.0f} ms "
                         f"({p95 / (bound * 1e3) - 1:+.0%})")  # fmt: skip
    return "; ".join(parts)


def why_lost(t: Trial, best: Trial, slo: dict[str, float]) -> str:
    if t.excluded:
        return t.excluded
    if t is best:
        return "best"
    if not t.useful_tokens:
        return "no request met the SLO: " + slo_miss(t, slo)
    ratio = t.usd_per_million_useful / best.usd_per_million_useful
    reasons = [f"{ratio:.2f}x the cost per useful token"]
    if abs(ratio - 1) < 5e-3:
        e2e = lambda x: ((x.summary or {}).get("e2e_ms") or {}).get("p95") or 0.0  # noqa: E731
        if abs(e2e(t) - e2e(best)) < 0.5:
            return "identical figures (a tie goes to the configuration tried first)"
        reasons = [f"same cost; p95 E2E {e2e(t):.0f} ms vs {e2e(best):.0f} ms"]
    if t.attainment < best.attainment - 0.005:
        reasons.append(f"SLO attainment {t.attainment:.0%} vs {best.attainment:.0%}")
    if t.gpus > best.gpus:
        reasons.append(f"{t.gpus} GPUs vs {best.gpus}")
    return "; ".join(reasons)


def serve_command(model: str, settings: dict[str, Any], tp: int = 1) -> str:
    """The ``kvserve serve`` line that runs a configuration (one replica's)."""
    parts = ["kvserve serve", model]
    tp = settings.get("tp", tp)
    if tp > 1:
        parts.append(f"--tensor-parallel-size {tp}")
    engine = settings_of(EngineConfig)
    for name, v in settings.items():
        if name not in engine or v is None:
            continue
        flag = engine[name].flag
        if isinstance(v, bool):  # a switch: its --no- form where it is off
            if v != engine[name].default:
                parts.append(flag if v else "--no-" + flag.removeprefix("--"))
        else:
            parts.append(f"{flag} {v}")
    line = " ".join(parts)
    if settings.get("replicas", 1) > 1:
        router = settings.get("router", "round_robin")
        line += (
            f"\n# run {settings['replicas']} replicas behind kvserve router "
            f"--routing-logic {router}"
        )
    return line


def why_not_runnable(model: str, settings: dict[str, Any]) -> list[str]:
    """Why the ``kvserve serve`` line of a configuration cannot start as it is (none: it
    can): a model given as a bare config.json has no weights."""
    reasons = []
    model_dir = Path(model_dir_of(model))
    if checkpoint_bytes(model_dir) is None:
        reasons.append(f"{model_dir} holds no weights (a config.json alone); put the "
                       "checkpoint's safetensors beside it")  # fmt: skip
    return reasons


def recommendation(model: str, settings: dict[str, Any], tp: int = 1) -> str:
    """The winner as the command that runs it, or, when it cannot start as it is
    (:func:`why_not_runnable`), as a plan that says why."""
    indented = "\n".join("  " + x for x in serve_command(model, settings, tp).splitlines())
    reasons = why_not_runnable(model, settings)
    if not reasons:
        return f"run it:\n{indented}"
    why = "".join(f"\n  - {r}" for r in reasons)
    return f"plan, not a command to run yet:{why}\n{indented}"


def pareto_front(trials: list[Trial]) -> list[Trial]:
    """Eligible trials no other beats on both cost per useful token and p95 TTFT."""
    pts = [t for t in trials if t.summary is not None and t.usd_per_million_useful < math.inf]

    def p95(t: Trial) -> float:
        return (t.summary or {}).get("ttft_ms", {}).get("p95") or math.inf

    front = []
    for t in pts:
        dominated = any(
            (o.usd_per_million_useful <= t.usd_per_million_useful and p95(o) <= p95(t))
            and (o.usd_per_million_useful < t.usd_per_million_useful or p95(o) < p95(t))
            for o in pts
        )
        if not dominated:
            front.append(t)
    return sorted(front, key=lambda t: t.usd_per_million_useful)


def plot_pareto(result: TuneResult, path: Path) -> Path | None:
    """Cost per useful token against p95 TTFT, every trial a dot, the front a line."""
    from kvserve.bench.report import _pyplot

    plt = _pyplot()
    if plt is None:
        return None
    pts = [t for t in result.trials if t.summary and t.usd_per_million_useful < math.inf]
    if not pts:
        return None

    def p95(t: Trial) -> float:
        return float((t.summary or {})["ttft_ms"]["p95"])

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    ax.scatter([p95(t) for t in pts], [t.usd_per_million_useful for t in pts], s=18,
               color="0.6", label="tried")  # fmt: skip
    front = sorted(pareto_front(pts), key=p95)
    ax.plot([p95(t) for t in front], [t.usd_per_million_useful for t in front], "o-",
            color="C0", label="Pareto front")  # fmt: skip
    best = result.best
    if best is not None and best.summary:
        ax.scatter([p95(best)], [best.usd_per_million_useful], s=80, marker="*", color="C3",
                   zorder=3, label="best")  # fmt: skip
    ax.set_xlabel("p95 TTFT (ms)")
    ax.set_ylabel("$ per million useful output tokens")
    ax.set_title("kvserve tune: cost vs latency")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
