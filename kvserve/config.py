"""Engine configuration as validated data.

Every dataclass validates itself once in ``__post_init__`` and raises :class:`ConfigError`
with a message that names the field and its allowed values. Nothing here imports torch, so
tools such as ``kvserve plan`` can use it on a machine without an accelerator stack.

The engine's configs (:class:`EngineConfig` and those nested in it) are the one source of
every engine setting: each field's default is written here once, with its help and choices
in ``field(metadata=...)`` (:mod:`kvserve.config_fields` lists the keys), and ``LLM(...)``'s
keyword arguments and the engine flags are generated from them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvserve import envs

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "lpm", "priority")
# greedy: admit while the next chunk fits; projected: while the whole request (prompt after
# hits, plus its expected output) fits beside what running requests will still grow by.
ADMISSION_POLICIES = ("greedy", "projected")
ALLOWED_BLOCK_SIZES = tuple(2**i for i in range(9))  # 1, 2, 4, ... 256


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field."""


def user_cache_dir() -> Path:
    """Where kvserve keeps what it derives or downloads and can obtain again (built kernels,
    checkpoint fingerprints, prepared models, benchmark checkpoints): ``$KVSERVE_CACHE``,
    else ``$KVSERVE_CACHE_DIR`` (the older name), else ``$XDG_CACHE_HOME/kvserve``, else
    ``~/.cache/kvserve``."""
    return (
        envs.KVSERVE_CACHE
        or envs.KVSERVE_CACHE_DIR
        or (envs.XDG_CACHE_HOME or Path(os.path.expanduser("~/.cache"))) / "kvserve"
    )


def parse_capture_sizes(value: str | list[int] | tuple[int, ...]) -> str:
    """``cuda_graph_sizes`` as its canonical text (sorted, distinct, comma-separated) from
    text such as ``"1,2,4"``, a list of integers, or the words of vLLM's space-separated flag
    (``--cuda-graph-sizes 1 2 4``); each size an integer in [1, 1024]."""
    words = [value] if isinstance(value, str) else list(value)
    items = [x for w in words for x in (w.split(",") if isinstance(w, str) else [w])]
    sizes = set()
    for x in items:
        try:
            n = int(str(x).strip())
        except ValueError:
            n = 0
        if isinstance(x, bool) or not 1 <= n <= 1024:
            raise ConfigError(
                f"cuda_graph_sizes: each size must be an integer in [1, 1024], got {value!r}"
            )
        sizes.add(n)
    if not sizes:
        raise ConfigError(f"cuda_graph_sizes: give at least one size, got {value!r}")
    return ",".join(str(n) for n in sorted(sizes))


def parse_bytes(value: int | float | str, field_name: str = "kv_cache_memory") -> int:
    """Parse ``2GiB``, ``512 MiB``, ``1.5GB``, ``1e9`` or a plain integer into bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{field_name}: expected a size such as '2GiB', got {value!r}")
    if isinstance(value, int | float):
        if value <= 0:
            raise ConfigError(f"{field_name}: must be > 0 bytes, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B?|B)?\s*", str(value))
    if not m:
        raise ConfigError(
            f"{field_name}: expected a size such as '2GiB', '512MiB' or a byte count, got {value!r}"
        )
    number, unit = float(m.group(1)), (m.group(2) or "B").upper()
    scale = {"B": 1}
    for i, p in enumerate("KMGT", start=1):
        scale[f"{p}IB"] = scale[f"{p}I"] = 1024**i
        scale[f"{p}B"] = scale[p] = 1000**i
    nbytes = int(number * scale[unit])
    if nbytes <= 0:
        raise ConfigError(f"{field_name}: must be > 0 bytes, got {value!r}")
    return nbytes


@dataclass(slots=True)
class ModelConfig:
    """The architecture facts the engine needs, read from a Hugging Face ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    # Per-layer sliding window (None = full attention for that layer).
    layer_windows: tuple[int | None, ...] = ()
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    k_scale: float | None = None
    v_scale: float | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architectures: unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads <= 0 or self.num_key_value_heads <= 0:
            raise ConfigError("num_attention_heads / num_key_value_heads: must be > 0")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads: {self.num_key_value_heads} must divide "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if not self.layer_windows:
            self.layer_windows = (None,) * self.num_hidden_layers
        if len(self.layer_windows) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types: {len(self.layer_windows)} entries for "
                f"{self.num_hidden_layers} layers"
            )

    @property
    def model_type(self) -> str:
        return {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}.get(
            self.architecture, "mistral"
        )

    def num_parameters(self) -> int:
        """Parameter count from the shapes (embeddings counted once when tied)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size
        layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + emb + h

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            mt = cfg.get("model_type")
            archs = [
                {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
                    mt, "MistralForCausalLM" if mt == "mistral" else str(mt)
                )
            ]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"architectures: unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as e:
            raise ConfigError(f"config.json: missing required field {e.args[0]!r}") from None
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)

        # transformers >= 5 writes rope_parameters; older configs write rope_theta/rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope else None)
        partial = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        if scaling is not None:
            scaling = dict(scaling)
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            if rtype not in ("default", "linear", "llama3"):
                raise ConfigError(
                    f"rope_scaling.rope_type: unsupported {rtype!r}; supported: default, "
                    "linear, llama3"
                )
            scaling["rope_type"] = rtype
            if rtype == "default":
                scaling = None

        layer_windows = _layer_windows(cfg, arch, layers)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            layer_windows=layer_windows,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            k_scale=cfg.get("k_scale"),
            v_scale=cfg.get("v_scale"),
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        p = Path(path)
        cfg_path = p / "config.json" if p.is_dir() else p
        if not cfg_path.exists():
            where = "model directory" if not p.exists() else "config.json"
            raise FileNotFoundError(f"model: {where} not found: {cfg_path}")
        with open(cfg_path) as f:
            return cls.from_dict(json.load(f))


def _layer_windows(cfg: dict[str, Any], arch: str, layers: int) -> tuple[int | None, ...]:
    """Which layers use sliding-window attention, following transformers' rules."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if not window:
        return (None,) * layers
    if arch == "Qwen2ForCausalLM":
        if not cfg.get("use_sliding_window", False):
            return (None,) * layers
        first = int(cfg.get("max_window_layers", layers))
        return tuple(window if i >= first else None for i in range(layers))
    return (int(window),) * layers


OFFLOAD_WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
PREEMPTION_MODES = ("swap", "recompute")


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache: block geometry, pool size, storage format, prefix caching, and the
    offload tiers behind the pool. Prefix-cache blocks evicted from the pool go down to the
    tiers (each bounded, LRU) and come back as hits; entries are checksummed and keyed by the
    model's weights, the KV format and the tenant, so a wrong entry is a miss, never wrong
    output."""

    block_size: int = field(
        default=16,
        metadata={"help": "tokens per KV block, a power of two from 1 to 256: the unit of "
                  "allocation and of prefix-cache hits"},
    )  # fmt: skip
    num_gpu_blocks: int | None = field(
        default=None,
        metadata={"help": "KV blocks in the pool (None: as many as --kv-cache-memory holds, "
                  "else on CUDA what --gpu-memory-utilization leaves, else enough for "
                  "--max-num-seqs full-length sequences, at most 4 GiB)"},
    )  # fmt: skip
    kv_cache_memory: int | str | None = field(
        default=None,
        metadata={"help": "bytes for the KV pool, e.g. 2GiB", "metavar": "SIZE", "unit": "bytes"},
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata={"help": "CUDA: fraction of the GPU's memory for weights, activations and "
                  "the KV pool, in (0, 1]; the pool gets what a profiling forward at "
                  "--max-num-batched-tokens leaves (vLLM's); ignored on a CPU and with "
                  "--num-gpu-blocks or --kv-cache-memory; kvserve plan and simulate --gpu "
                  "apply it to the card's memory less the weights", "metavar": "FRACTION"},
    )  # fmt: skip
    kv_cache_dtype: str = field(
        default="auto",
        metadata={"help": "KV storage format (auto: the compute dtype); the fp8, int8 and "
                  "KIVI formats are lossy", "choices": "kvserve.kv.formats:KV_CACHE_DTYPES"},
    )  # fmt: skip
    enable_prefix_caching: bool = field(
        default=True,
        metadata={"help": "reuse the KV blocks of prompt prefixes computed before (lossless)"},
    )
    calculate_kv_scales: bool = field(
        default=False,
        metadata={"help": "fp8 KV: compute the scales from the first keys and values instead "
                  "of reading the checkpoint's"},
    )  # fmt: skip
    kv_retention: str | None = field(
        default=None,
        metadata={"metavar": "SPEC", "help": "KV retention policy, lossy, off by default: "
                  "'window:W' keeps each token's W most recent cache entries (W tokens, or "
                  "'window:50%' of each prompt) and returns older blocks to the pool; "
                  "'sinks:4,window:508' keeps the first 4 as well (StreamingLLM); "
                  "'snapkv:512' keeps the 512 prompt tokens its last 32 queries attend to "
                  "most, plus those 32; 'h2o:512' keeps the 512 entries with the most "
                  "attention mass (a quarter of them the newest) (kvserve.sched.retention)"},
    )  # fmt: skip
    # Offload tiers behind the pool (kvserve.kv.offload), each off unless given.
    kv_offload_cpu: int | str | None = field(
        default=None,
        metadata={
            "help": "host-memory tier of this size (e.g. 8GiB)",
            "metavar": "SIZE",
            "unit": "bytes",
        },
    )
    kv_offload_disk: str | None = field(
        default=None,
        metadata={"help": "local-disk tier in this directory (entries survive a restart)",
                  "metavar": "DIR"},
    )  # fmt: skip
    kv_offload_disk_size: int | str = field(
        default="10GiB",
        metadata={
            "help": "bytes of entries kept in the disk tier",
            "metavar": "SIZE",
            "unit": "bytes",
        },
    )
    kv_offload_redis: str | None = field(
        default=None,
        metadata={"help": "Redis tier, redis://HOST:PORT/DB (shared by replicas on one "
                  "server)", "metavar": "URL"},
    )  # fmt: skip
    kv_offload_redis_size: int | str = field(
        default="1GiB",
        metadata={"help": "bytes of entries kept in Redis, across all replicas",
                  "metavar": "SIZE", "unit": "bytes"},
    )  # fmt: skip
    kv_offload_timeout: float = field(
        default=0.5,
        metadata={"help": "bound on one tier operation; a load gives up after ten",
                  "metavar": "SECONDS"},
    )  # fmt: skip
    # SGLang's names.
    kv_offload_write_policy: str = field(
        default="write_back",
        metadata={"help": "when a block goes down: when the pool evicts it (write_back), as "
                  "soon as it is computed (write_through), or once it has been hit "
                  "--kv-offload-reuse-threshold times (write_through_selective)",
                  "choices": OFFLOAD_WRITE_POLICIES},
    )  # fmt: skip
    kv_offload_reuse_threshold: int = field(
        default=2,
        metadata={"help": "write_through_selective: hits before a block is written down",
                  "metavar": "N"},
    )  # fmt: skip
    # Device prefix hits are taken in either mode: they cost nothing.
    preemption_mode: str | None = field(
        default=None,
        metadata={"help": "a preempted request's blocks come back from the tiers (swap; "
                  "the default with a tier) or are computed again (recompute; the only mode "
                  "without a tier)", "choices": PREEMPTION_MODES},
    )  # fmt: skip
    disable_hybrid_kv_cache_manager: bool = field(
        default=False,
        metadata={"help": "hybrid models (full and sliding-window layers): one block table "
                  "for every layer, so blocks behind the windows are not freed (as vLLM's "
                  "flag)"},
    )  # fmt: skip
    # vLLM zero-fills its KV space at start; KVStorage.prefault says why it matters.
    kv_cache_prefault: bool = field(
        default=False,
        metadata={"help": "CPU: fault the KV pool's pages in at start, as vLLM's zero-filled "
                  "KV space is, so the first requests do not pay a page fault per 4 KiB of "
                  "new KV (start-up takes longer and the whole pool is resident from the "
                  "start)"},
    )  # fmt: skip

    @property
    def kv_offload(self) -> bool:
        """Whether any offload tier is configured."""
        return bool(self.kv_offload_cpu or self.kv_offload_disk or self.kv_offload_redis)

    def __post_init__(self) -> None:
        if self.block_size not in ALLOWED_BLOCK_SIZES:
            raise ConfigError(
                f"block_size: must be a power of two from 1 to 256, got {self.block_size}"
            )
        if self.num_gpu_blocks is not None and self.kv_cache_memory is not None:
            raise ConfigError("num_gpu_blocks / kv_cache_memory: give one or the other, not both")
        if self.num_gpu_blocks is not None and (
            not isinstance(self.num_gpu_blocks, int) or self.num_gpu_blocks < 1
        ):
            raise ConfigError(f"num_gpu_blocks: must be an integer >= 1, got {self.num_gpu_blocks}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, int | float) or not 0 < u <= 1:
            raise ConfigError(f"gpu_memory_utilization: must be in (0, 1], got {u!r}")
        if not isinstance(self.kv_cache_prefault, bool):
            raise ConfigError(f"kv_cache_prefault: must be true or false, got "
                              f"{self.kv_cache_prefault!r}")  # fmt: skip
        if not isinstance(self.kv_cache_dtype, str):
            raise ConfigError(f"kv_cache_dtype: must be a format name, got {self.kv_cache_dtype!r}")
        # The names are the KV format registry's (kvserve.kv.formats); the engine checks them.
        if self.kv_retention is not None and not isinstance(self.kv_retention, str):
            raise ConfigError(f"kv_retention: must be a policy such as 'window:512', got "
                              f"{self.kv_retention!r}")  # fmt: skip
        if self.kv_offload_cpu is not None:
            self.kv_offload_cpu = parse_bytes(self.kv_offload_cpu, "kv_offload_cpu")
        self.kv_offload_disk_size = parse_bytes(self.kv_offload_disk_size, "kv_offload_disk_size")
        self.kv_offload_redis_size = parse_bytes(
            self.kv_offload_redis_size, "kv_offload_redis_size"
        )
        for name in ("kv_offload_disk", "kv_offload_redis"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ConfigError(f"{name}: expected a non-empty string, got {value!r}")
        t = self.kv_offload_timeout
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0.001 <= t <= 60:
            raise ConfigError(f"kv_offload_timeout: must be seconds in [0.001, 60], got {t!r}")
        if self.kv_offload_write_policy not in OFFLOAD_WRITE_POLICIES:
            raise ConfigError(
                f"kv_offload_write_policy: must be one of {', '.join(OFFLOAD_WRITE_POLICIES)}, "
                f"got {self.kv_offload_write_policy!r}"
            )
        n = self.kv_offload_reuse_threshold
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1000:
            raise ConfigError(f"kv_offload_reuse_threshold: must be an integer in [1, 1000], "
                              f"got {n!r}")  # fmt: skip
        if self.preemption_mode is None:
            self.preemption_mode = "swap" if self.kv_offload else "recompute"
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"preemption_mode: must be one of {', '.join(PREEMPTION_MODES)}, "
                              f"got {self.preemption_mode!r}")  # fmt: skip
        if self.preemption_mode == "swap" and not self.kv_offload:
            raise ConfigError(
                "preemption_mode: swap needs an offload tier to swap to (kv_offload_cpu, "
                "kv_offload_disk or kv_offload_redis)"
            )
        if self.kv_offload and not self.enable_prefix_caching:
            raise ConfigError(
                "kv_offload_*: offload tiers hold prefix-cache blocks; they need "
                "enable_prefix_caching"
            )
        if self.kv_offload and self.calculate_kv_scales:
            raise ConfigError(
                "kv_offload_*: not with calculate_kv_scales (scales computed per "
                "run would make every run's entries unreadable by the next)"
            )


@dataclass(slots=True)
class SchedulerConfig:
    """Continuous batching: sequences and tokens per step, the waiting queue's order, and
    admission control."""

    max_num_seqs: int = field(
        default=256, metadata={"help": "sequences in one step at most (running requests)"}
    )
    max_num_batched_tokens: int = field(
        default=2048,
        metadata={"help": "tokens in one step at most, prefill chunks and decode tokens "
                  "together", "unit": "tokens"},
    )  # fmt: skip
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "prompt plus output tokens of one request at most (None: the "
                  "model's max_position_embeddings)", "unit": "tokens"},
    )  # fmt: skip
    enable_chunked_prefill: bool = field(
        default=True,
        metadata={"help": "split a long prompt's prefill over steps, beside other requests' "
                  "decode tokens"},
    )  # fmt: skip
    scheduling_policy: str = field(
        default="fcfs",
        metadata={"help": "fcfs; lpm: longest cached prefix first; priority: each request's "
                  "priority field, lower first (vLLM's); each bounded against starvation",
                  "choices": SCHEDULING_POLICIES},
    )  # fmt: skip
    lpm_max_skips: int = field(
        default=32,
        metadata={"help": "lpm, priority and projected admission: a waiting request passed "
                  "over this many times is scheduled next regardless (the bound on "
                  "starvation)", "metavar": "N"},
    )  # fmt: skip
    admission: str = field(
        default="greedy",
        metadata={"help": "greedy: admit while a request's next chunk fits (vLLM's); "
                  "projected: while its whole prompt after prefix hits plus its expected "
                  "output fits beside what running requests will still grow by, and refuse "
                  "(429/503) requests whose workload class's TTFT SLO cannot be met",
                  "choices": ADMISSION_POLICIES},
    )  # fmt: skip
    admission_watermark: float = field(
        default=0.01,
        metadata={"help": "projected: the fraction of KV blocks kept free beyond every "
                  "admitted request's projection", "metavar": "FRACTION"},
    )  # fmt: skip
    hold_prefix_followers: bool = field(
        default=True,
        metadata={"help": "a request whose next prefix block another request computes in "
                  "this step waits one step and hits it, instead of computing it again "
                  "beside it"},
    )  # fmt: skip
    async_scheduling: bool = field(
        default=False,
        metadata={"help": "plan and send each step before the one in flight has landed, so "
                  "workers in other processes (tensor parallelism, the mp executor) go from "
                  "step to step without waiting for the engine; a request that ends costs "
                  "one wasted position; not with a KV connector (vLLM's)"},
    )  # fmt: skip
    workload_classes: str | None = field(
        default=None,
        metadata={"help": "workload classes (YAML or JSON; 'default' for chat, rag, "
                  "long-document and agent): per-class SLO, priority, output estimate and KV "
                  "policy (kvserve.sched.workload_classes)", "metavar": "FILE"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len: must be >= 1, got {self.max_model_len}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(
                f"scheduling_policy: must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        if self.lpm_max_skips < 0:
            raise ConfigError(f"lpm_max_skips: must be >= 0, got {self.lpm_max_skips}")
        if self.admission not in ADMISSION_POLICIES:
            raise ConfigError(
                f"admission: must be one of {', '.join(ADMISSION_POLICIES)}, got {self.admission!r}"
            )
        w = self.admission_watermark
        if isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w < 1:
            raise ConfigError(f"admission_watermark: must be in [0, 1), got {w!r}")


LOAD_FAILURE_POLICIES = ("recompute", "fail")
# vLLM's kv_role values: a prefill engine produces KV, a decode engine consumes it, kv_both does
# either (per request, as its kv_transfer_params say).
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# Connectors built in under a name (no kv_connector_module_path needed): name -> module.
BUILTIN_CONNECTORS = {"KVServeConnector": "kvserve.disagg.connector"}


def json_object_fields(value: Any, cls: type, name: str) -> dict[str, Any]:
    """A JSON-object setting (a dict, or its text as the CLI gives it) as keyword arguments of
    the dataclass ``cls``: refused, naming the setting ``name``, when it is not an object or
    names a field ``cls`` lacks."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"{name}: not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name}: expected a JSON object, got {value!r}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"{name}: unknown field(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(known))}")  # fmt: skip
    return value


@dataclass(slots=True)
class KVTransferConfig:
    """A KV connector of the user's (vLLM's ``kv_transfer_config`` fields): a class named in
    ``kv_connector``, imported from ``kv_connector_module_path``, built on each side of the
    engine with ``(role, engine_config)``; and what a failed load does (``recompute`` the
    blocks, or ``fail`` the request), for every connector, the offload tiers included."""

    kv_connector: str | None = None
    kv_connector_module_path: str | None = None
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_load_failure_policy: str = "recompute"
    # Disaggregated prefill/decode (kvserve.disagg): this engine's role, its id in the
    # kv_transfer_params it hands out, and where its KV side channel listens.
    kv_role: str | None = None
    engine_id: str | None = None
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579

    def __post_init__(self) -> None:
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ConfigError(
                f"kv_load_failure_policy: must be one of {', '.join(LOAD_FAILURE_POLICIES)}, "
                f"got {self.kv_load_failure_policy!r}"
            )
        if self.kv_connector_module_path is not None and not self.kv_connector:
            raise ConfigError("kv_connector: give the class name with kv_connector_module_path")
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ConfigError(f"kv_role: must be one of {', '.join(KV_ROLES)}, "
                              f"got {self.kv_role!r}")  # fmt: skip
        port = self.kv_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"kv_port: must be an integer in [0, 65535], got {port!r}")
        if (
            self.kv_connector is not None
            and not self.kv_connector_module_path
            and self.kv_connector not in BUILTIN_CONNECTORS
        ):
            raise ConfigError(
                f"kv_connector_module_path: the module to import {self.kv_connector!r} from "
                f"(built in: {', '.join(BUILTIN_CONNECTORS)})"
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ConfigError("kv_connector_extra_config: must be a JSON object")

    @classmethod
    def from_any(cls, value: Any) -> KVTransferConfig:
        """From a KVTransferConfig, a dict, or a JSON object text (the CLI's form)."""
        if isinstance(value, cls):
            return value
        return cls(**json_object_fields(value, cls, "kv_transfer_config"))


EVENT_PUBLISHERS = ("null", "zmq")


@dataclass(slots=True)
class KVEventsConfig:
    """KV cache events (vLLM's ``kv_events_config`` fields): what the block pool and the offload
    tiers hold, published as stored / removed / cleared batches on vLLM's wire format
    (:mod:`kvserve.kv.events`), so a router written for vLLM reads them.

    ``endpoint``: the PUB socket (bound when it holds ``*``, ``::``, ``ipc://`` or
    ``inproc://``, else connected, as in vLLM; a ``*`` port binds a free one, logged at
    start); ``replay_endpoint``: the ROUTER socket a subscriber asks for missed batches from a
    sequence number; ``buffer_steps``: batches kept for replay; ``hwm``: the PUB socket's
    high-water mark; ``topic``: the first frame of every message."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError("kv_events_config.enable_kv_cache_events: must be true or false")
        if self.publisher not in EVENT_PUBLISHERS:
            raise ConfigError(f"kv_events_config.publisher: must be one of "
                              f"{', '.join(EVENT_PUBLISHERS)}, got {self.publisher!r}")  # fmt: skip
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"kv_events_config.{name}: must be an integer >= 1, got {v!r}")
        for name in ("endpoint", "replay_endpoint"):
            v = getattr(self, name)
            if v is None and name == "replay_endpoint":
                continue
            if not isinstance(v, str) or "://" not in v:
                raise ConfigError(f"kv_events_config.{name}: must be a ZMQ endpoint such as "
                                  f"'tcp://*:5557', got {v!r}")  # fmt: skip
        if not isinstance(self.topic, str):
            raise ConfigError(f"kv_events_config.topic: must be a string, got {self.topic!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_any(cls, value: Any) -> KVEventsConfig:
        """From a KVEventsConfig, a dict, or a JSON object text (the CLI's form)."""
        if isinstance(value, cls):
            return value
        return cls(**json_object_fields(value, cls, "kv_events_config"))


# uni: the model runs in the engine's process; mp: in worker processes the engine drives;
# ray: in Ray actors, one per device, on a Ray cluster (the optional extra kvserve[ray]);
# external_launcher: every process of a torchrun launch runs the whole engine as one rank.
EXECUTOR_BACKENDS = ("uni", "mp", "ray", "external_launcher")


@dataclass(slots=True)
class ParallelConfig:
    """Where the model runs: in the engine's process or in worker processes (vLLM's
    ``distributed_executor_backend``), and over how many tensor-parallel ranks."""

    distributed_executor_backend: str = field(
        default="uni",
        metadata={"help": "uni: the model runs in the engine's process; mp: in worker "
                  "processes the engine sends each step to; ray: in Ray actors, one per "
                  "device (kvserve[ray]); external_launcher: each process of a torchrun "
                  "launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) is one rank running "
                  "the same requests; with --tensor-parallel-size above 1, uni means mp "
                  "(vLLM's flag)",
                  "choices": EXECUTOR_BACKENDS},
    )  # fmt: skip
    tensor_parallel_size: int = field(
        default=1,
        metadata={"aliases": ("-tp",), "metavar": "N",
                  "help": "tensor-parallel ranks: each holds a 1/N shard of every layer and "
                  "only its KV heads, joined by torch.distributed (gloo on a CPU, NCCL on "
                  "CUDA); the attention heads must divide by N (vLLM's flag)"},
    )  # fmt: skip
    disable_custom_all_reduce: bool = field(
        default=False,
        metadata={"help": "tensor parallelism on a CPU: all-reduce through torch.distributed "
                  "(gloo) even where every rank shares one host, instead of through shared "
                  "memory (vLLM's flag)"},
    )  # fmt: skip
    nnodes: int = field(
        default=1,
        metadata={"metavar": "K",
                  "help": "machines the mp backend's tensor-parallel ranks span, "
                  "tensor_parallel_size / K on each: node 0 runs the engine, every other node "
                  "runs `kvserve serve ... --headless` with its --node-rank (vLLM's flag)"},
    )  # fmt: skip
    node_rank: int = field(
        default=0,
        metadata={"help": "this machine's index among --nnodes: 0 runs the engine (vLLM's "
                  "flag)"},
    )  # fmt: skip
    master_addr: str = field(
        default="127.0.0.1",
        metadata={"help": "with --nnodes above 1: node 0's address, which every node reaches "
                  "(vLLM's flag)"},
    )  # fmt: skip
    master_port: int | None = field(
        default=None,
        metadata={"help": "with --nnodes above 1: node 0's port for the ranks' "
                  "torch.distributed rendezvous; node r's calls and replies use the next "
                  "ports, master_port + r (vLLM's flag)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ConfigError(
                f"distributed_executor_backend: must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}"
            )
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= 1024:
            raise ConfigError(f"tensor_parallel_size: must be an integer in [1, 1024], got {tp!r}")
        if tp > 1 and self.distributed_executor_backend == "uni":
            self.distributed_executor_backend = "mp"  # one process holds one rank
        self._check_nodes()

    def _check_nodes(self) -> None:
        k, r, tp = self.nnodes, self.node_rank, self.tensor_parallel_size
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= tp:
            raise ConfigError(f"nnodes: must be an integer in [1, tensor_parallel_size = {tp}], "
                              f"got {k!r}")  # fmt: skip
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < k:
            raise ConfigError(f"node_rank: must be an integer in [0, nnodes = {k}), got {r!r}")
        if k == 1:
            return
        if tp % k:
            raise ConfigError(f"tensor_parallel_size: {tp} ranks do not divide evenly over "
                              f"nnodes = {k} nodes")  # fmt: skip
        if self.distributed_executor_backend != "mp":
            raise ConfigError(f"distributed_executor_backend: nnodes above 1 runs the mp "
                              f"backend's workers on every node, got "
                              f"{self.distributed_executor_backend!r}")  # fmt: skip
        port = self.master_port
        if port is None:
            raise ConfigError("master_port: required with nnodes above 1 (node 0's "
                              "rendezvous port, which every node names)")  # fmt: skip
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65536 - k:
            raise ConfigError(
                f"master_port: must be an integer in [1, {65536 - k}] (ports "
                f"master_port to master_port + {k - 1} are used), got {port!r}"
            )
        if not self.master_addr:
            raise ConfigError("master_addr: required with nnodes above 1 (node 0's address)")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


# llguidance: the default (broadest JSON-schema coverage, ~ms compiles, no invalid instance
# accepted in JSONSchemaBench); xgrammar: vLLM's and SGLang's default, the optional extra
# kvserve[xgrammar].
STRUCTURED_OUTPUTS_BACKENDS = ("llguidance", "xgrammar")
# vLLM's spellings: "guidance" is its name for llguidance; "auto" lets the engine choose.
STRUCTURED_OUTPUTS_BACKEND_ALIASES = {"guidance": "llguidance", "auto": "llguidance"}


@dataclass(slots=True)
class StructuredOutputsConfig:
    """Structured outputs: the grammar library that compiles a request's JSON schema, regex,
    choice or grammar, and how long a compile may take."""

    structured_outputs_backend: str = field(
        default="llguidance",
        metadata={"help": "the grammar library behind structured outputs (vLLM's "
                  "--structured-outputs-config.backend): llguidance, or xgrammar (the "
                  "optional extra kvserve[xgrammar]); vLLM's 'guidance' and 'auto' mean "
                  "llguidance", "choices": (*STRUCTURED_OUTPUTS_BACKENDS,
                                           *STRUCTURED_OUTPUTS_BACKEND_ALIASES)},
    )  # fmt: skip
    structured_outputs_compile_timeout: float = field(
        default=5.0,
        metadata={"metavar": "SECONDS",
                  "help": "seconds a constraint may take to compile; a longer one is refused "
                  "(a 400 naming the field) instead of stalling the engine"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        backend = self.structured_outputs_backend
        self.structured_outputs_backend = STRUCTURED_OUTPUTS_BACKEND_ALIASES.get(backend, backend)
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ConfigError(
                "structured_outputs_backend: must be one of "
                f"{', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, got {self.structured_outputs_backend!r}"
            )
        t = self.structured_outputs_compile_timeout
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t <= 600:
            raise ConfigError(
                f"structured_outputs_compile_timeout: must be in (0, 600] seconds, got {t!r}"
            )


@dataclass(slots=True)
class EngineConfig:
    """The model and where it runs; the KV cache's and the scheduler's settings are nested.

    Everything the engine needs. :class:`kvserve.LLM`'s keyword arguments and the engine
    flags are these fields and those of the nested configs, generated in one place
    (:mod:`kvserve.config_fields`), so a setting is a field with its default and its
    ``metadata`` (help, choices) and is written nowhere else. The first paragraph of each
    config's docstring heads its group of flags in ``--help``."""

    model: str = field(
        metadata={"help": "model name (kvserve-ref, smollm2), HF directory or .gguf file, "
                  "or Hugging Face hub id (org/name[@revision]: from the HF cache, downloaded "
                  "when online)"}
    )  # fmt: skip
    revision: str | None = field(
        default=None,
        metadata={"help": "the hub id's revision: a branch, tag or commit (None: main); "
                  "a local path or model name ignores it"},
    )  # fmt: skip
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "directory of the tokenizer.json (None: the model's)"},
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "weights' and activations' dtype (auto: the checkpoint's "
                  "torch_dtype, float32 where it names none; for a GGUF file bfloat16 on a "
                  "GPU or on a CPU with AVX512-BF16 or AMX, else float32)", "choices": DTYPES},
    )  # fmt: skip
    device: str = field(
        default="cpu", metadata={"help": "torch device of the model and the KV pool"}
    )
    enforce_eager: bool = field(
        default=False,
        metadata={"help": "CUDA: run every step eagerly, capturing no CUDA graphs (vLLM's); "
                  "a CPU always runs eagerly"},
    )  # fmt: skip
    cuda_graph_sizes: str | None = field(
        default=None,
        metadata={"help": "CUDA: the decode batch sizes captured in CUDA graphs, e.g. "
                  "'1 2 4 8' (vLLM's form) or '1,2,4,8' (None: vLLM's 1, 2, 4, "
                  "then multiples of 8 up to --max-num-seqs, at most 256); a larger batch "
                  "runs eagerly",
                  "metavar": "N", "nargs": "+"},
    )  # fmt: skip
    seed: int = field(default=0, metadata={"help": "seed of the sampler's random generator"})
    # The name is checked against the registry and the device when the engine is built
    # (this module sits below the registry).
    attention_backend: str | None = field(
        default=None,
        metadata={"help": "how attention is computed: 'torch' (gather + SDPA, the reference, "
                  "any device), 'cpu' (kvserve's C kernels, the reference wherever one "
                  "declines) or 'triton' (GPU kernels that read every KV format in place; "
                  "CUDA, or a CPU under TRITON_INTERPRET=1 for tests); 'auto' or none picks by "
                  "device: 'cpu' on a CPU where the kernels build, else 'torch'",
                  "choices": "kvserve.attention.registry:ATTENTION_BACKEND_CHOICES"},
    )  # fmt: skip
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    # One setting, given whole as JSON (vLLM's --kv-transfer-config): not walked into.
    kv_transfer_config: KVTransferConfig = field(
        default_factory=KVTransferConfig,
        metadata={"json": True, "metavar": "JSON",
                  "help": "a KV connector of your own, as vLLM's: '{\"kv_connector\": "
                  "\"Class\", \"kv_connector_module_path\": \"module\", "
                  "\"kv_connector_extra_config\": {...}}'; and \"kv_load_failure_policy\": "
                  "\"recompute\" (default) or \"fail\" for a load that fails, the offload "
                  "tiers' included"},
    )  # fmt: skip

    kv_events_config: KVEventsConfig = field(
        default_factory=KVEventsConfig,
        metadata={"json": True, "metavar": "JSON",
                  "help": "KV cache events, as vLLM's: '{\"enable_kv_cache_events\": true, "
                  "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                  "\"replay_endpoint\": \"tcp://*:5558\", \"buffer_steps\": 10000, "
                  "\"hwm\": 100000, \"topic\": \"\"}': the blocks the pool and the offload "
                  "tiers store and remove, on vLLM's wire format (docs/router.md)"},
    )  # fmt: skip

    def __post_init__(self) -> None:
        self.kv_transfer_config = KVTransferConfig.from_any(self.kv_transfer_config or {})
        self.kv_events_config = KVEventsConfig.from_any(self.kv_events_config or {})
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.seed, int):
            raise ConfigError(f"seed: must be an integer, got {self.seed!r}")
        if self.revision is not None and (not isinstance(self.revision, str)
                                          or not self.revision.strip()):  # fmt: skip
            raise ConfigError(f"revision: must be a branch, tag or commit, got {self.revision!r}")
        if self.cuda_graph_sizes is not None:
            self.cuda_graph_sizes = parse_capture_sizes(self.cuda_graph_sizes)
        if self.scheduler.async_scheduling and (
            self.cache.kv_offload or self.kv_transfer_config.kv_connector
        ):
            raise ConfigError(
                "async_scheduling: not with a KV connector (kv_transfer_config) or an offload "
                "tier (kv_offload_cpu, kv_offload_disk, kv_offload_redis): their per-step "
                "reports need the step before to have landed; leave one of them off"
            )
        if self.attention_backend is not None and (
            not isinstance(self.attention_backend, str) or not self.attention_backend
        ):
            raise ConfigError(
                f"attention_backend: must be a backend name or None, got {self.attention_backend!r}"
            )
