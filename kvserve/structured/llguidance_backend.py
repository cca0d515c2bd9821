"""llguidance (the default): JSON schemas, regexes and Lark grammars compiled by its Earley
parser over a lazily built token trie. The compile here builds one matcher (which parses the
grammar and reports errors); each sample's matcher is a ``deep_copy`` of it. A JSON schema's
repeated ``format``/``pattern`` subschemas go to llguidance as one shared definition each
(:mod:`kvserve.structured.shared_subschemas`), since it compiles such a regex at every place
it occurs."""

from __future__ import annotations

import llguidance
import llguidance.torch
import torch

from kvserve.structured.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    Matcher,
    choice_literals,
)
from kvserve.structured.params import StructuredOutputsParams
from kvserve.structured.shared_subschemas import share_repeated_subschemas


class LLGuidanceMatcher(Matcher):
    __slots__ = ("m",)

    def __init__(self, m: llguidance.LLMatcher) -> None:
        self.m = m

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.m, bitmask, row)

    def accept_token(self, token: int) -> bool:
        return self.m.consume_token(token)

    def is_terminated(self) -> bool:
        return self.m.is_stopped()


class LLGuidanceGrammar(CompiledGrammar):
    def __init__(self, template: llguidance.LLMatcher) -> None:
        self.template = template

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.template.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]
    ) -> None:
        super().__init__(tokenizer_json, vocab_size, eos_token_ids)
        eos = list(eos_token_ids) or None
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def grammar_text(self, p: StructuredOutputsParams, schema: dict | None = None) -> str:
        """The grammar llguidance compiles; ``schema``: the JSON schema to use in place of
        the request's (the same language, rewritten)."""
        kind = p.kind
        if kind in ("json", "json_object"):
            ws = p.whitespace()
            options: dict = (
                {"whitespace_flexible": False}
                if ws is None
                else {"whitespace_flexible": True, "whitespace_pattern": ws}
            )
            schema = p.schema() if schema is None else schema
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(p.regex)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(f"start: {choice_literals(p.choice)}")
        return llguidance.LLMatcher.grammar_from_lark(p.grammar)

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        if params.kind == "json":
            schema = params.schema()
            shared = share_repeated_subschemas(schema)
            if shared is not schema:
                try:
                    return self._compile(params, shared)
                except GrammarError:
                    pass  # compiled as written below, so an error names the client's schema
            return self._compile(params, schema)
        return self._compile(params, None)

    def _compile(self, params: StructuredOutputsParams, schema: dict | None) -> LLGuidanceGrammar:
        try:
            text = self.grammar_text(params, schema)
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(str(e)) from None
        # Building the matcher compiles the grammar and reports its errors (a separate
        # validate_grammar call would compile it twice).
        m = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if m.is_error():
            raise GrammarError(m.get_error())
        return LLGuidanceGrammar(m)

    def fill_bitmasks(self, matchers: list[Matcher], bitmask: torch.Tensor) -> None:
        pairs = [(m.m, row) for row, m in enumerate(matchers)]  # type: ignore[attr-defined]
        llguidance.torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)
