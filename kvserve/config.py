"""Engine configuration as validated data.

Every dataclass validates itself once in ``__post_init__`` and raises :class:`ConfigError`
with a message that names the field and its allowed values. Nothing here imports torch, so
tools such as ``kvserve plan`` can use it on a machine without an accelerator stack.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    base = (
        os.environ.get("KVSERVE_CACHE")
        or os.environ.get("KVSERVE_CACHE_DIR")
        or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve"
        )
    )
    return Path(base)


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
    """Paged KV cache: block geometry, pool size, storage format and prefix caching."""

    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    calculate_kv_scales: bool = False
    # Default KV retention policy ("window:512"; kvserve.sched.retention), None = keep everything.
    kv_retention: str | None = None
    # Offload tiers behind the pool (kvserve.kv.offload), each off unless given: host memory,
    # a local directory, a Redis server; each bounded and LRU. The timeout bounds one tier
    # operation (a load gives up after ten of them).
    kv_offload_cpu: int | str | None = None
    kv_offload_disk: str | None = None
    kv_offload_disk_size: int | str = "10GiB"
    kv_offload_redis: str | None = None
    kv_offload_redis_size: int | str = "1GiB"
    kv_offload_timeout: float = 0.5
    # When a block goes down (SGLang's names): write_back when the pool evicts it;
    # write_through as soon as it is computed; write_through_selective once it has been hit
    # kv_offload_reuse_threshold times.
    kv_offload_write_policy: str = "write_back"
    kv_offload_reuse_threshold: int = 2
    # A preempted request's published blocks come back from the tiers (swap, the default with
    # a tier) or are computed again (recompute, the only mode without one; vLLM's name). Device
    # prefix hits are taken either way: they cost nothing.
    preemption_mode: str | None = None
    # Hybrid models (full and sliding-window layers): one table for every layer instead of
    # one per layer group, so nothing behind the windows is freed (vLLM's flag).
    disable_hybrid_kv_cache_manager: bool = False
    # Fault the CPU pool's pages in at start (vLLM zero-fills its KV space there) instead of
    # at each block's first write: slower start, pool resident from the start, and the first
    # pass through the pool runs at the steady rate (KVStorage.prefault says why it matters).
    kv_cache_prefault: bool = False

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
    """Continuous batching limits: sequences per step and the per-step token budget."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    # lpm, priority and projected admission: a waiting request passed over this many times
    # is scheduled next regardless (the bound on starvation).
    lpm_max_skips: int = 32
    admission: str = "greedy"
    # projected: blocks kept free beyond every admitted request's projection (a fraction).
    admission_watermark: float = 0.01
    # A follower whose next prefix block another request computes in this step waits one
    # step and hits it, instead of computing it again beside it.
    hold_prefix_followers: bool = True
    # A workload-class file (kvserve.sched.workload_classes), "default" for the built-in classes.
    workload_classes: str | None = None

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


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs; built by :class:`kvserve.llm.LLM` from keyword args."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # How attention is computed (kvserve.attention.registry: "torch", "cpu"); None or "auto":
    # chosen by device. The name is checked against the registry, and against the device,
    # when the engine is built (this module sits below the registry).
    attention_backend: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.seed, int):
            raise ConfigError(f"seed: must be an integer, got {self.seed!r}")
        if self.attention_backend is not None and (
            not isinstance(self.attention_backend, str) or not self.attention_backend
        ):
            raise ConfigError(
                f"attention_backend: must be a backend name or None, got {self.attention_backend!r}"
            )
