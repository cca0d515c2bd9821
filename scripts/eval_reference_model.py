"""Measure the reference model's long-context recall and held-out perplexity with transformers.

Greedy exact match is checked by teacher forcing: the greedy continuation equals the expected
answer iff every answer token is the argmax given the prompt and the answer tokens before it, so
one forward pass per prompt suffices (``--generate N`` cross-checks N prompts with a real greedy
``generate``). Prompts come from kvserve/quality/tasks.py, as the quality gate's will.

  python scripts/eval_reference_model.py kvserve-ref --json /tmp/recall.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvserve.model.resolve import resolve_model  # noqa: E402
from kvserve.quality import tasks as T  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model", help="model name (kvserve-ref, ...) or HF model directory")
    ap.add_argument("--lengths", default="256,512,1024,1536,2048")
    ap.add_argument("--depths", default="0,5,10,25,50,75,90,100")
    ap.add_argument("--per-cell", type=int, default=3)
    ap.add_argument("--others", type=int, default=30, help="prompts per other task")
    ap.add_argument("--ppl-passages", type=int, default=16)
    ap.add_argument("--generate", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=not text.startswith(T.BOS)).input_ids)

    @torch.inference_mode()
    def check(p: T.TaskPrompt) -> tuple[bool, int]:
        ids = tok(p.prompt, add_special_tokens=p.add_special_tokens).input_ids
        full = tok(p.prompt + p.answer, add_special_tokens=p.add_special_tokens).input_ids
        assert full[: len(ids)] == ids, "answer does not start at a token boundary"
        logits = model(torch.tensor([full])).logits[0]
        pred = logits[len(ids) - 1 : -1].argmax(-1).tolist()
        return pred == full[len(ids) :], len(ids)

    t0 = time.time()
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    grid: dict[str, dict[str, float]] = {}
    hits = early_hits = early_n = n = 0
    for L in lengths:
        for dp in depths:
            ok = 0
            for i in range(args.per_cell):
                seed = L * 100_003 + int(dp * 10) * 101 + i
                good, _ = check(T.needle_prompt(seed, L, dp, count))
                ok += good
                if dp <= 10:
                    early_hits, early_n = early_hits + good, early_n + 1
            grid.setdefault(str(L), {})[f"{dp:g}"] = ok / args.per_cell
            hits, n = hits + ok, n + args.per_cell
        print(f"len {L}: " + " ".join(f"{v:.2f}" for v in grid[str(L)].values()), flush=True)
    report = {
        "needle_recall": hits / n,
        "needles": n,
        "needle_recall_depth_0_10": early_hits / max(early_n, 1),
        "needles_depth_0_10": early_n,
        "grid": grid,
    }
    others = {
        "multi_needle_4": lambda s, L: T.multi_needle_prompt(s, L, count, num_needles=4),
        "multi_needle_8": lambda s, L: T.multi_needle_prompt(s, L, count, num_needles=8),
        "variable_tracking_1hop": lambda s, L: T.variable_tracking_prompt(s, L, count, hops=1),
        "variable_tracking_2hop": lambda s, L: T.variable_tracking_prompt(s, L, count, hops=2),
        "multi_turn": lambda s, L: T.multi_turn_prompt(s, L, count),
    }
    for name, fn in others.items():
        res = [check(fn(7_000 + i, lengths[i % len(lengths)]))[0] for i in range(args.others)]
        report[name] = sum(res) / len(res)
        print(f"{name}: {report[name]:.3f}", flush=True)
    nll = ntok = 0.0
    with torch.inference_mode():
        for text in T.heldout_passages(args.ppl_passages, 1024, count, seed=0):
            ids = torch.tensor([tok(text).input_ids])
            logits = model(ids).logits[0, :-1]
            nll += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            ntok += ids.shape[1] - 1
    report["heldout_ppl"] = math.exp(nll / ntok)
    report["heldout_tokens"] = int(ntok)
    agree = 0
    for i in range(args.generate):
        p = T.needle_prompt(9_000 + i, 1024, 50.0, count)
        ids = torch.tensor([tok(p.prompt).input_ids])
        ans = tok(p.answer, add_special_tokens=False).input_ids
        out = model.generate(ids, max_new_tokens=len(ans), do_sample=False)[0, ids.shape[1] :]
        agree += (out.tolist() == ans) == check(p)[0]
    report["generate_agrees_with_teacher_forcing"] = f"{agree}/{args.generate}"
    report["seconds"] = round(time.time() - t0, 1)
    print(json.dumps({k: v for k, v in report.items() if k != "grid"}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
