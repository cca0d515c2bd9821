"""What structured outputs cost, per grammar library (llguidance, xgrammar), on SmolLM2
(49k vocabulary) by default.

1. Compile: each of the 20 test-style schemas and a set of larger real-world-shaped schemas
   (API objects with tens of properties, formats, ``$ref`` definitions, ``anyOf``), compiled
   cold (a fresh compiler, no cache): p50 and p99 in ms over both sets together, and per set;
   then each again through the same compiler (a cache hit: a repeated tool schema).
2. Mask: one matcher's bitmask fill per token while walking the grammar with random allowed
   tokens: p50 in microseconds.
3. Serving: a batch of JSON-schema requests vs the same requests unconstrained (the same
   prompts, each forced to the constrained run's output length with ``ignore_eos``, so both
   runs do the same steps): TPOT overhead = constrained / unconstrained decode time - 1,
   measured in the same run; and the fraction of finished constrained outputs that validate
   with ``jsonschema``.

4. With ``--outputs 500``: that many outputs across the 20 schemas on the bundled model at
   temperature 1 (``n`` = 3), each finished one validated with ``jsonschema``.

    .venv/bin/python -m benchmarks.structured [--quick] [--model smollm2] [--outputs 500]

The last line is one JSON object: ``tpot_overhead``, ``compile_ms_p50``, ``compile_ms_p99``,
``mask_us_p50`` and ``valid_fraction`` of the default backend (llguidance), and the same per
backend.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from benchmarks.common import bench_model, emit, median, set_threads, table

# The 20 schemas of the correctness tests (enums, patterns, nested objects, bounded arrays and
# integers, CJK and emoji strings).
from tests.test_structured_outputs import SCHEMAS

BACKENDS = ("llguidance", "xgrammar")


_FIELD_TYPES = (
    {"type": "string", "maxLength": 64},
    {"type": "integer", "minimum": 0},
    {"type": "number"},
    {"type": "boolean"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "uri"},
    {"type": "string", "enum": ["active", "pending", "closed", "archived"]},
    {"type": "array", "items": {"type": "string", "maxLength": 32}, "maxItems": 8},
    {"anyOf": [{"type": "string"}, {"type": "null"}]},
)


def real_world_schemas(n: int, seed: int = 0) -> list[dict]:
    """API-object-shaped schemas (the kind JSONSchemaBench's GitHub and Kubernetes sets hold):
    10-60 properties of mixed types and formats, nested objects, ``$defs`` with ``$ref``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        props = {f"field_{j}": rng.choice(_FIELD_TYPES) for j in range(rng.randint(10, 60))}
        item = {"type": "object", "properties": {f"k{j}": rng.choice(_FIELD_TYPES)
                                                 for j in range(rng.randint(3, 12))}}  # fmt: skip
        props["items"] = {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 5}
        props["owner"] = {"type": "object", "properties": {
            "login": {"type": "string", "pattern": "^[a-z][a-z0-9-]{2,20}$"},
            "id": {"type": "integer"}}, "required": ["login", "id"]}  # fmt: skip
        required = rng.sample(sorted(props), k=min(len(props), rng.randint(2, 8)))
        out.append({"$defs": {"item": item}, "type": "object", "title": f"Resource{i}",
                    "properties": props, "required": required})  # fmt: skip
    return out


def compile_times(
    backend: str, model_dir: str, vocab: int, eos: tuple, schemas: list
) -> tuple[list[float], list[float]]:
    """Each schema's compile and first matcher, in ms: cold (a fresh compiler, nothing
    cached), then again through the same compiler (the cache's hit)."""
    from kvserve.structured.compiler import GrammarCompiler
    from kvserve.structured.params import StructuredOutputsParams

    compiler = GrammarCompiler(backend, model_dir, vocab, eos, timeout=60.0)
    compiler.backend()  # the tokenizer is read once per process, not per schema
    passes: tuple[list[float], list[float]] = ([], [])
    for times in passes:
        for s in schemas:
            p = StructuredOutputsParams(json=s)
            t0 = time.perf_counter()
            compiler.compile(p).matcher()
            times.append((time.perf_counter() - t0) * 1e3)
    return passes


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def mask_times(backend: str, model_dir: str, vocab: int, eos: tuple, schemas: list,
               steps: int) -> list[float]:  # fmt: skip
    """One matcher's mask fill per token (us), walking each grammar by random allowed tokens."""
    from kvserve.sample.token_bitmask import bitmask_words, unpack_bitmask
    from kvserve.structured.compiler import GrammarCompiler
    from kvserve.structured.params import StructuredOutputsParams

    compiler = GrammarCompiler(backend, model_dir, vocab, eos, timeout=60.0)
    rng = random.Random(0)
    mask = torch.full((1, bitmask_words(vocab)), -1, dtype=torch.int32)
    times = []
    for s in schemas:
        m = compiler.compile(StructuredOutputsParams(json=s)).matcher()
        for _ in range(steps):
            if m.is_terminated():
                break
            mask.fill_(-1)
            t0 = time.perf_counter()
            m.fill_bitmask(mask, 0)
            times.append((time.perf_counter() - t0) * 1e6)
            allowed = unpack_bitmask(mask, vocab)[0].nonzero()[:, 0].tolist()
            allowed = [t for t in allowed if t not in eos] or allowed
            if not allowed:
                break
            m.accept_token(rng.choice(allowed))
    return times


def serve(model: str, backend: str, batch: int, max_tokens: int, schemas: list) -> dict[str, Any]:
    """TPOT of a constrained batch vs the same batch unconstrained at the same lengths."""

    from kvserve import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(model, max_num_seqs=batch, max_model_len=1024, seed=0,
              structured_outputs_backend=backend)  # fmt: skip
    chosen = [schemas[i % len(schemas)] for i in range(batch)]
    prompts = [f"Reply with JSON matching this schema: {json.dumps(s)}\n" for s in chosen]
    cons = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                           structured_outputs=StructuredOutputsParams(json=s))
            for i, s in enumerate(chosen)]  # fmt: skip
    llm.generate(prompts[:2], cons[:2])  # warm-up: compile, first steps

    def decode_time(params: list) -> tuple[float, list]:
        eng = llm.engine
        for p, sp in zip(prompts, params, strict=True):
            eng.add_request(None, p, sp)
        outs, step_times = {}, []
        while eng.has_unfinished_requests():
            t0 = time.perf_counter()
            for o in eng.step():
                if o.finished:
                    outs[int(o.request_id)] = o
            step_times.append(time.perf_counter() - t0)
        return sum(step_times[1:]), [outs[k] for k in sorted(outs)]

    t_con, outs = decode_time(cons)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
             for i, n in enumerate(lengths)]  # fmt: skip
    t_plain = decode_time(plain)[0]
    # alternated, best of two each: a noisy machine slows one run, not the comparison
    t_con = min(t_con, decode_time(cons)[0])
    t_plain = min(t_plain, decode_time(plain)[0])
    finished, valid = count_valid([(o.outputs[0], s) for o, s in zip(outs, chosen, strict=True)])
    llm.shutdown()
    return {"tpot_overhead": t_con / t_plain - 1, "finished": finished,
            "valid_fraction": valid / finished if finished else None,
            "tokens": sum(lengths)}  # fmt: skip


def count_valid(samples: list[tuple[Any, dict]]) -> tuple[int, int]:
    """(finished, valid): of the (completion, schema) pairs, those that finished with "stop" and
    those of them whose text is JSON that validates against its schema."""
    import jsonschema

    finished = valid = 0
    for c, schema in samples:
        if c.finish_reason != "stop":
            continue
        finished += 1
        try:
            jsonschema.validate(json.loads(c.text), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return finished, valid


def correctness(outputs: int, backend: str) -> dict[str, Any]:
    """``outputs`` outputs across the 20 schemas at temperature 1 on the bundled model (one
    third as ``n`` = 3): the fraction of finished ones that validate with ``jsonschema``."""

    from kvserve import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM("kvserve-ref", max_model_len=512, structured_outputs_backend=backend)
    per = -(-outputs // (len(SCHEMAS) * 3))
    prompts, params, schemas = [], [], []
    for i, s in enumerate(SCHEMAS):
        so = StructuredOutputsParams(json=s)
        for j in range(per):
            prompts.append(f"JSON {i} {j}:")
            params.append(SamplingParams(temperature=1.0, n=3, max_tokens=96, seed=i * 1000 + j,
                                         structured_outputs=so))  # fmt: skip
            schemas.append(s)
    samples = [(c, s) for out, s in zip(llm.generate(prompts, params), schemas, strict=True)
               for c in out.outputs]  # fmt: skip
    total = len(samples)
    finished, valid = count_valid(samples)
    llm.shutdown()
    return {"outputs": total, "finished": finished,
            "valid_fraction": valid / finished if finished else None}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller batch, fewer schemas")
    ap.add_argument("--model", default="smollm2", help="model name or path (default smollm2)")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--outputs", type=int, default=0,
                    help="also generate this many outputs (e.g. 500) on the bundled model "
                    "across the 20 schemas and validate them")  # fmt: skip
    ap.add_argument(
        "--skip-serving",
        action="store_true",
        help="compile and mask times only (no TPOT, no valid_fraction)",
    )
    args = ap.parse_args()
    threads = set_threads()
    from kvserve.config import ModelConfig

    model_dir = bench_model(args.model)
    mc = ModelConfig.from_pretrained(model_dir)
    vocab, eos = mc.vocab_size, tuple(mc.eos_token_ids)
    world = real_world_schemas(10 if args.quick else 60)
    batch, max_tokens = (8, 48) if args.quick else (32, 128)
    rows, per = [], {}
    for backend in args.backends.split(","):
        cold, cached = compile_times(backend, model_dir, vocab, eos, SCHEMAS + world)
        tests, api = cold[: len(SCHEMAS)], cold[len(SCHEMAS) :]
        masks = mask_times(backend, model_dir, vocab, eos, SCHEMAS[:10] if args.quick else SCHEMAS,
                           16 if args.quick else 64)  # fmt: skip
        run = {"tpot_overhead": None, "valid_fraction": None, "finished": 0}
        if not args.skip_serving:
            run = serve(args.model, backend, batch, max_tokens, SCHEMAS)
        r = {"backend": backend, "compile_ms_p50": median(cold), "compile_ms_p99": p99(cold),
             "compile_ms_p50_tests": median(tests), "compile_ms_p99_tests": p99(tests),
             "compile_ms_p50_api": median(api), "compile_ms_p99_api": p99(api),
             "compile_cached_ms_p50": median(cached), "mask_us_p50": median(masks),
             "tpot_overhead": run["tpot_overhead"], "valid_fraction": run["valid_fraction"],
             "finished": run["finished"]}  # fmt: skip
        rows.append(r)
        per[backend] = r
    cols = ["backend", "compile_ms_p50", "compile_ms_p99", "mask_us_p50", "tpot_overhead",
            "valid_fraction", "finished"]  # fmt: skip
    print(f"model {args.model}, vocab {vocab}, batch {batch}, {threads} threads, "
          f"{len(SCHEMAS)} + {len(world)} schemas compiled cold")  # fmt: skip
    print(table(rows, cols))
    print(
        f"compile (ms) by set: {len(SCHEMAS)} test schemas, {len(world)} API-object-shaped "
        f"ones; cached: all {len(SCHEMAS) + len(world)} again through the same compiler"
    )
    set_cols = ["backend", "compile_ms_p50_tests", "compile_ms_p99_tests", "compile_ms_p50_api",
                "compile_ms_p99_api", "compile_cached_ms_p50"]  # fmt: skip
    print(table(rows, set_cols))
    if args.outputs:
        for backend in args.backends.split(","):
            c = correctness(args.outputs, backend)
            print(
                f"{backend}: {c['outputs']} outputs on kvserve-ref, {c['finished']} finished, "
                f"valid fraction {c['valid_fraction']:.3f}"
            )
            per[backend]["correctness_valid_fraction"] = c["valid_fraction"]
            per[backend]["correctness_outputs"] = c["outputs"]
    head = per.get("llguidance") or rows[0]
    summary = {k: head[k] for k in cols[1:-1]}
    summary.update({k: head[k] for k in set_cols[1:]})
    summary.update({f"{r['backend']}_{k}": r[k] for r in rows for k in cols[1:-1] + set_cols[1:]})
    for r in rows:
        for k in ("correctness_valid_fraction", "correctness_outputs"):
            if k in r:
                summary[f"{r['backend']}_{k}"] = r[k]
    summary.update(model=args.model, batch=batch, quick=args.quick)
    emit(summary)


if __name__ == "__main__":
    main()
