"""``LLM.generate``'s options that vLLM's offline API has beside the prompts and parameters."""

from __future__ import annotations

from kvserve import SamplingParams


def test_generate_reports_progress_as_vllm_use_tqdm_does(checkpoint, make_llm, capsys):
    """``use_tqdm``: a callable is called as tqdm is and sees one update per finished prompt
    and one close; True draws tqdm's bar on stderr. Neither changes the outputs."""
    llm = make_llm(checkpoint("llama_gqa"), dtype="float32")
    prompts, params = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0)
    calls: list = []

    class Bar:
        def __init__(self, **kw):
            calls.append(("new", kw))

        def update(self, n):
            calls.append(("update", n))

        def close(self):
            calls.append(("close",))

    plain = llm.generate(prompts, params)
    barred = llm.generate(prompts, params, use_tqdm=Bar)
    assert calls == [("new", {"total": 3, "desc": "Processed prompts"}),
                     *[("update", 1)] * 3, ("close",)]  # fmt: skip
    assert [o.outputs[0].token_ids for o in barred] == [o.outputs[0].token_ids for o in plain]
    capsys.readouterr()
    llm.generate(prompts, params, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err
