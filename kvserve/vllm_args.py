"""vLLM's engine and server arguments that kvserve lacks, each with what to do instead: the
kvserve equivalent, "planned", or why it does not apply. One table for both entry points: an
unknown ``--flag`` on the command line (:mod:`kvserve.cli`) and an unknown ``LLM(keyword=)``
(:func:`kvserve.config_fields.build_config`) are answered from it, so a vLLM user gets a
pointer instead of argparse's "unrecognized arguments" or a bare ``TypeError``.

The names are read from vLLM's ``EngineArgs`` (``vllm/engine/arg_utils.py``) and its server's
``FrontendArgs`` (``vllm/entrypoints/openai/cli_args.py``): the commonly used ones kvserve does
not take. A vLLM argument kvserve has under the same name is not here (``--block-size``,
``--max-num-seqs``, ...); tests/test_cli_grammar.py checks that no entry names a kvserve flag
and that every equivalent named is one. A leaf module: it imports nothing of kvserve.
"""

from __future__ import annotations

from dataclasses import dataclass

USE = "use"  # kvserve has the setting under another name or form
PLANNED = "planned"  # kvserve will have it; ``use`` may name what serves meanwhile
UNSUPPORTED = "unsupported"  # kvserve does not do this; ``note`` says what it does
NOT_APPLICABLE = "not applicable"  # the question does not arise in kvserve (note: why)


@dataclass(frozen=True, slots=True)
class VLLMArg:
    """One vLLM argument kvserve lacks."""

    flag: str  # vLLM's long flag
    kind: str  # USE, PLANNED, UNSUPPORTED or NOT_APPLICABLE
    why: str = ""  # what the equivalent means, or why kvserve does without
    use: str | None = None  # kvserve's flag to use instead (meanwhile, when planned)
    planned: str = ""  # what is planned
    aliases: tuple[str, ...] = ()  # vLLM's short forms: -tp, -pp, -q
    engine: bool = True  # a field of vLLM's EngineArgs (so an LLM(...) keyword); else serve's

    @property
    def keyword(self) -> str:
        """The argument as a Python keyword (``gpu_memory_utilization``)."""
        return self.flag.removeprefix("--").replace("-", "_")

    def flag_message(self) -> str:
        """What ``kvserve CMD --flag`` answers."""
        return self._message(self.flag, self.use)

    def keyword_message(self) -> str:
        """What ``LLM(keyword=...)`` answers: the equivalent as a keyword too."""
        use = None if self.use is None else self.use.removeprefix("--").replace("-", "_") + "="
        return self._message(self.keyword, use)

    def _message(self, name: str, use: str | None) -> str:
        tail = f"; use {use}" + (f" ({self.why})" if self.why else "") if use else (
            f"; {self.why}" if self.why else ""
        )  # fmt: skip
        if self.kind == PLANNED:
            return f"{name} is planned ({self.planned}) and not supported by kvserve yet{tail}"
        if self.kind == NOT_APPLICABLE:
            return f"{name} is not applicable to kvserve: {self.why}"
        if self.kind == UNSUPPORTED:
            return f"{name} is not supported by kvserve: {self.why}"
        return f"{name} is not supported by kvserve{tail}"


_NO_LORA = "kvserve serves no LoRA adapters"
_NO_TLS = "kvserve serves plain HTTP; terminate TLS at a reverse proxy in front of it"
_NO_CORS = "kvserve sends no CORS headers; add them at a reverse proxy in front of it"

_TABLE = (
    # -- vLLM's EngineArgs: the engine, so also LLM(...) keywords ---------------------------
    VLLMArg("--kv-cache-memory-bytes", USE, "the same setting; sizes such as 4GiB",
            "--kv-cache-memory"),
    VLLMArg("--num-gpu-blocks-override", USE, "KV blocks in the pool", "--num-gpu-blocks"),
    VLLMArg("--swap-space", USE, "a host-memory tier behind the pool; a preempted request's "
            "blocks swap to it", "--kv-offload-cpu"),
    VLLMArg("--cpu-offload-gb", UNSUPPORTED, "weights stay on the device "
            "(--kv-offload-cpu offloads KV blocks)"),
    VLLMArg("--kv-offloading-backend", USE, "kvserve's tiers are --kv-offload-cpu, "
            "--kv-offload-disk and --kv-offload-redis", "--kv-offload-cpu"),
    VLLMArg("--pipeline-parallel-size", UNSUPPORTED, "a model is split by tensor "
            "parallelism (--tensor-parallel-size), not by layers", aliases=("-pp",)),
    VLLMArg("--data-parallel-size", UNSUPPORTED, "data parallelism is replicas: run several "
            "`kvserve serve` behind `kvserve router`", aliases=("-dp",)),
    VLLMArg("--enable-expert-parallel", NOT_APPLICABLE, "kvserve serves dense models (Llama, "
            "Qwen2, Mistral), not mixtures of experts", aliases=("-ep",)),
    VLLMArg("--compilation-config", USE, "kvserve compiles no model code (no "
            "torch.compile); the decode batch sizes its CUDA graphs capture are",
            "--cuda-graph-sizes"),
    VLLMArg("--quantization", UNSUPPORTED, "weights are computed dense (a GGUF file's are "
            "dequantized at load); --kv-cache-dtype quantizes the KV cache", aliases=("-q",)),
    VLLMArg("--trust-remote-code", NOT_APPLICABLE, "kvserve runs only its own model code "
            "(Llama, Qwen2, Mistral families) and never imports a checkpoint's"),
    VLLMArg("--tokenizer-mode", UNSUPPORTED, "kvserve reads the model's tokenizer.json (or a "
            "GGUF file's vocabulary)"),
    VLLMArg("--load-format", UNSUPPORTED, "kvserve loads safetensors checkpoints and GGUF "
            "files, told apart by the model path"),
    VLLMArg("--max-logprobs", UNSUPPORTED, "kvserve returns up to 20 logprobs per token, "
            "vLLM's default"),
    VLLMArg("--enable-lora", UNSUPPORTED, _NO_LORA),
    VLLMArg("--max-loras", UNSUPPORTED, _NO_LORA),
    VLLMArg("--max-lora-rank", UNSUPPORTED, _NO_LORA),
    VLLMArg("--speculative-config", UNSUPPORTED, "no speculative decoding"),
    VLLMArg("--limit-mm-per-prompt", NOT_APPLICABLE, "kvserve serves text-only models"),
    VLLMArg("--prefix-caching-hash-algo", UNSUPPORTED, "the block hash is fixed: SHA-256 "
            "chains (docs/router.md)"),
    VLLMArg("--disable-sliding-window", UNSUPPORTED, "sliding-window layers always attend "
            "within their window"),
    VLLMArg("--long-prefill-token-threshold", UNSUPPORTED, "chunked prefill splits a prompt "
            "by --max-num-batched-tokens"),
    VLLMArg("--max-num-partial-prefills", UNSUPPORTED, "chunked prefill splits a prompt by "
            "--max-num-batched-tokens"),
    VLLMArg("--structured-outputs-config", USE, "the grammar library; compile time limit: "
            "--structured-outputs-compile-timeout", "--structured-outputs-backend"),
    VLLMArg("--guided-decoding-backend", USE, "the grammar library (vLLM's older name)",
            "--structured-outputs-backend"),
    VLLMArg("--reasoning-parser", UNSUPPORTED, "reasoning is not split from content"),
    # -- vLLM's serve (FrontendArgs): the server only ---------------------------------------
    VLLMArg("--uvicorn-log-level", USE, "", "--log-level", engine=False),
    VLLMArg("--disable-uvicorn-access-log", USE, "", "--disable-access-log", engine=False),
    VLLMArg("--ssl-keyfile", UNSUPPORTED, _NO_TLS, engine=False),
    VLLMArg("--ssl-certfile", UNSUPPORTED, _NO_TLS, engine=False),
    VLLMArg("--ssl-ca-certs", UNSUPPORTED, _NO_TLS, engine=False),
    VLLMArg("--allowed-origins", UNSUPPORTED, _NO_CORS, engine=False),
    VLLMArg("--allow-credentials", UNSUPPORTED, _NO_CORS, engine=False),
    VLLMArg("--allowed-methods", UNSUPPORTED, _NO_CORS, engine=False),
    VLLMArg("--allowed-headers", UNSUPPORTED, _NO_CORS, engine=False),
    VLLMArg("--root-path", UNSUPPORTED, "serve under a path prefix through a reverse proxy "
            "that strips it", engine=False),
    VLLMArg("--uds", UNSUPPORTED, "kvserve listens on --host and --port", engine=False),
    VLLMArg("--chat-template", UNSUPPORTED, "kvserve applies the tokenizer's own chat "
            "template", engine=False),
    VLLMArg("--lora-modules", UNSUPPORTED, _NO_LORA, engine=False),
    VLLMArg("--middleware", UNSUPPORTED, "kvserve adds no user ASGI middleware", engine=False),
    VLLMArg("--api-server-count", UNSUPPORTED, "kvserve runs one API server process",
            engine=False),
    VLLMArg("--response-role", UNSUPPORTED, "a chat response's role is always 'assistant'",
            engine=False),
    VLLMArg("--return-tokens-as-token-ids", UNSUPPORTED, "logprobs name tokens by their text",
            engine=False),
    VLLMArg("--enable-prompt-tokens-details", NOT_APPLICABLE, "kvserve always reports "
            "usage.prompt_tokens_details.cached_tokens", engine=False),
)  # fmt: skip

VLLM_ONLY_ARGS: dict[str, VLLMArg] = {a.flag: a for a in _TABLE}
_BY_OPTION: dict[str, VLLMArg] = {o: a for a in _TABLE for o in (a.flag, *a.aliases)}
_BY_KEYWORD: dict[str, VLLMArg] = {a.keyword: a for a in _TABLE if a.engine}


def vllm_flag(arg_string: str) -> VLLMArg | None:
    """The entry for a command-line word (``--gpu-memory-utilization``, ``--swap-space=4``,
    ``-tp``), or None when it is no vLLM argument kvserve lacks."""
    return _BY_OPTION.get(arg_string.split("=", 1)[0])


def vllm_keyword(name: str) -> VLLMArg | None:
    """The entry for an ``LLM(...)`` keyword vLLM's engine takes and kvserve does not."""
    return _BY_KEYWORD.get(name)
