"""xgrammar (the optional extra ``kvserve[xgrammar]``; vLLM's and SGLang's default): JSON
schemas, regexes and EBNF grammars compiled to a pushdown automaton with a precomputed token
cache. ``grammar`` is xgrammar's EBNF here, not Lark. Each sample's matcher is a new
``GrammarMatcher`` over the one compiled grammar."""

from __future__ import annotations

import json

import torch
import xgrammar as xgr
from tokenizers import Tokenizer as HFTokenizer
from transformers import PreTrainedTokenizerFast

from kvserve.structured.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    Matcher,
    choice_literals,
)
from kvserve.structured.params import StructuredOutputsParams

# xgrammar bounds a whitespace run by a count, not a pattern: the default pattern's bound.
MAX_WHITESPACE = 8


class XGrammarMatcher(Matcher):
    __slots__ = ("m",)

    def __init__(self, m: xgr.GrammarMatcher) -> None:
        self.m = m

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token: int) -> bool:
        return self.m.accept_token(token)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()


class XGrammarGrammar(CompiledGrammar):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(self.compiled))


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        super().__init__(tokenizer_json, vocab_size, eos_token_ids)
        hf = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tokenizer_json))
        info = xgr.TokenizerInfo.from_huggingface(
            hf, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids) or None
        )
        # kvserve keeps its own cache (kvserve.structured.compiler)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, p: StructuredOutputsParams) -> XGrammarGrammar:
        c = self.compiler
        try:
            kind = p.kind
            if kind in ("json", "json_object"):
                compact = p.disable_any_whitespace
                compiled = c.compile_json_schema(
                    json.dumps(p.schema()),
                    any_whitespace=not compact,
                    separators=(",", ":") if compact else None,
                    max_whitespace_cnt=None if compact else MAX_WHITESPACE,
                )
            elif kind == "regex":
                compiled = c.compile_regex(p.regex)
            elif kind == "choice":
                compiled = c.compile_grammar(f"root ::= {choice_literals(p.choice)}")
            else:
                compiled = c.compile_grammar(p.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(str(e)) from None
        return XGrammarGrammar(compiled)
