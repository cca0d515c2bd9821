"""KV retention policies: which cached tokens a sequence keeps, so that the others' blocks go
back to the pool.

``--kv-retention SPEC`` (off by default; lossy):

- ``window:W``: each token attends to the most recent W tokens only (itself included), in
  prefill and decode alike. Keys keep their positions (cache entry ``j`` is still token ``j``);
  the blocks wholly before every future query's window leave the block table (the null block
  stands in their place, so indices keep their meaning) and return to the pool as decoding and
  chunked prefill advance. This is Mistral's sliding window applied to any model: lossy unless
  the model was trained with it. A checkpoint whose every layer has a ``sliding_window`` gets
  the same block freeing on by default, and exact (the mask is the model's own).

- ``sinks:S,window:W`` (StreamingLLM): the first S tokens (the attention sinks) plus the W most
  recent. Blocks between them are released; the sink blocks stay. StreamingLLM assigns
  positions inside the cache, so a stream runs past ``max_position_embeddings``. Keys are stored
  after RoPE and RoPE scores depend only on the distance between query and key, so the kept
  window already has its in-cache distances (the window is contiguous and ends at the query);
  only the sinks' distance differs: in-cache it is ``min(p, S + W - 1) - s`` for a query at
  ``p``. Rather than re-rotating stored sink keys (which would change a block the prefix
  cache may share, and accumulate rounding each time), the query is rotated back by
  ``max(0, p - S - W + 1)`` for its scores against the sinks only. Stored K/V are never
  modified, so every KV format works; nothing is rotated twice. The engine may then run a
  stream past the model's position limit (``max_model_len`` up to any length): no query is
  ever farther than ``S + W`` positions from a key it sees (a bare window bounds distances
  too, so it may stream as well, which StreamingLLM shows is where it breaks down).

- ``snapkv:B[,obs:32,kernel:7]`` (SnapKV): the prompt is prefilled with full attention; in the
  step that computes its last chunk, every layer scores each prompt key by the attention the
  last ``obs`` prompt queries (the observation window) give it, summed over those queries and
  the query heads of each KV head, smoothed over ``kernel`` neighbouring keys, and each KV head
  keeps its top B keys plus the observation window. Keys are stored after RoPE, so a kept
  key carries its true position and different heads (and layers) may keep different tokens
  as long as each keeps the same count: the kept K/V are copied, in order, into fresh blocks
  and the prompt's blocks are released. Decoding then continues with RoPE positions past the
  prompt over a cache of ``B + obs`` entries. The prompt's own blocks were computed with full
  attention, so they are published to the prefix cache under the ordinary chain (everyone may
  share them); nothing after the compaction is published. Formats whose codes are per-token
  (bf16/fp16/fp32, fp8, int8) move entries bit for bit; KIVI quantizes keys per channel over
  a block, so it is refused. ``snapkv:50%`` keeps half of each prompt (observation window
  included). Prompt logits are computed before the compaction, so a perplexity over them does
  not see it.

- ``h2o:B[,recent:R]`` (H2O, heavy hitters + recent): every cache entry accumulates the
  attention mass each later query gives it (per layer and KV head, summed over the head's
  query heads), from the prompt's queries on. Whenever a step would leave more than B plus a
  block of entries, each KV head keeps its R most recent entries (default B // 4) and the
  B - R others with the most mass, copied into fresh blocks like SnapKV's, so blocks are
  freed in whole-block steps and each compaction is amortised over a block of decode steps.
  The mass comes from the attention itself: the fused paged kernel adds each entry's
  probability to it as a side output (a per-sequence float32 path does where a KV format has
  no such kernel). A prompt prefix cached by someone else
  has no mass, so H2O requests do not read the prefix cache (their blocks before the first
  compaction are exact and are published for everyone). ``h2o:50%`` sizes B per prompt.

Composition with prefix caching: a window or sinks request's K/V past the first W tokens
depend on the policy, so its blocks are hashed under a chain salted with the policy (requests
with the same policy share them; everyone else never sees them), and blocks it drops are
released, never changed in place. Every KV format works with ``window`` and ``sinks``
(dropping blocks is format-agnostic).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ConfigError

KINDS = ("window", "sinks", "snapkv", "h2o")
FIELD = "kv_retention"


def _bad(message: str) -> ConfigError:
    return ConfigError(f"{FIELD}: {message}")


@dataclass(frozen=True, slots=True)
class RetentionSpec:
    """A parsed ``--kv-retention`` value; ``kind`` is one of :data:`KINDS`."""

    kind: str
    window: int = 0  # window, sinks: recent tokens kept
    sinks: int = 0  # sinks: first tokens kept
    budget: int = 0  # snapkv: prompt tokens kept besides the window; h2o: entries kept
    obs: int = 32  # snapkv: observation window (queries that score the prompt)
    kernel: int = 7  # snapkv: pooling width over neighbouring keys
    recent: int = 0  # h2o: recent tokens always kept (0: budget // 4)
    # window (or snapkv's kept tokens) given as a share of each prompt ("window:50%": 2x
    # compression of the prompt); resolved per request by :meth:`for_prompt`.
    percent: int = 0
    # The policy as configured, for a spec that :meth:`for_prompt` resolved ("" otherwise):
    # what metrics are labelled with.
    label: str = ""

    def text(self) -> str:
        if self.kind == "window":
            return f"window:{self.percent}%" if self.percent else f"window:{self.window}"
        if self.kind == "sinks":
            window = f"{self.percent}%" if self.percent else self.window
            return f"sinks:{self.sinks},window:{window}"
        extra = ""
        budget = f"{self.percent}%" if self.percent else self.budget
        if self.kind == "snapkv" and (self.obs, self.kernel) != (32, 7):
            extra = f",obs:{self.obs},kernel:{self.kernel}"
        if self.kind == "h2o" and self.recent:
            extra = f",recent:{self.recent}"
        return f"{self.kind}:{budget}{extra}"

    @classmethod
    def parse(cls, text: str) -> RetentionSpec:
        """``window:512``, ``sinks:4,window:508``, ``snapkv:512[,obs:32,kernel:7]``,
        ``h2o:512[,recent:128]``; raises :class:`ConfigError` naming ``kv_retention``."""
        if not isinstance(text, str) or not text.strip():
            raise _bad(f"expected a policy such as 'window:512', got {text!r}")
        parts: dict[str, int] = {}
        order: list[str] = []
        percent = 0
        for item in text.replace(" ", "").split(","):
            key, sep, value = item.partition(":")
            if not sep or not value:
                raise _bad(f"{item!r} is not KEY:VALUE (in {text!r})")
            if key in parts:
                raise _bad(f"{key!r} given twice in {text!r}")
            if key in ("window", "snapkv", "h2o") and value.endswith("%"):
                try:
                    percent = int(value[:-1])
                except ValueError:
                    raise _bad(f"{key}: expected an integer percentage, got {value!r}") from None
                if not 1 <= percent <= 100:
                    raise _bad(f"{key}: a share of the prompt must be in [1%, 100%], got {value}")
                value = "0"
            try:
                parts[key] = int(value)
            except ValueError:
                raise _bad(f"{key}: expected an integer, got {value!r}") from None
            if parts[key] < 0:
                raise _bad(f"{key}: must be >= 0, got {parts[key]}")
            order.append(key)
        kind = order[0]
        allowed = {
            "window": {"window"},
            "sinks": {"sinks", "window"},
            "snapkv": {"snapkv", "obs", "kernel"},
            "h2o": {"h2o", "recent"},
        }
        if kind not in allowed:
            examples = "'window:512', 'sinks:4,window:508', 'snapkv:512', 'h2o:512'"
            raise _bad(f"unknown policy {kind!r}; known: {', '.join(KINDS)} (e.g. {examples})")
        extra = set(parts) - allowed[kind]
        if extra:
            raise _bad(f"{kind} takes {', '.join(sorted(allowed[kind]))}, not "
                       f"{', '.join(sorted(extra))}")  # fmt: skip
        if kind == "window":
            spec = cls("window", window=parts["window"], percent=percent)
        elif kind == "sinks":
            if "window" not in parts:
                raise _bad("sinks needs a window too: 'sinks:4,window:508'")
            spec = cls("sinks", window=parts["window"], sinks=parts["sinks"], percent=percent)
        elif kind == "snapkv":
            spec = cls("snapkv", budget=parts["snapkv"], obs=parts.get("obs", 32),
                       kernel=parts.get("kernel", 7), percent=percent)  # fmt: skip
        else:
            spec = cls("h2o", budget=parts["h2o"], recent=parts.get("recent", 0), percent=percent)
        return spec

    @property
    def bounds_distance(self) -> bool:
        """Whether no query ever sees a key farther away than the policy's budget, so RoPE
        positions past the model's limit are harmless (a window and sinks both; whether the
        model still makes sense without sinks is the quality gate's question)."""
        return self.kind in ("window", "sinks")

    @property
    def compacts(self) -> bool:
        """Whether the policy copies the kept K/V into fresh blocks (SnapKV) rather than only
        dropping whole blocks."""
        return self.kind in ("snapkv", "h2o")

    @property
    def observes(self) -> bool:
        """Whether the policy accumulates attention mass per cache entry (H2O)."""
        return self.kind == "h2o"

    @property
    def num_kept(self) -> int:
        """Cache entries a compaction leaves: SnapKV's budget plus its observation window,
        H2O's budget."""
        return self.budget if self.observes else self.budget + self.obs

    @property
    def metric_label(self) -> str:
        """What the eviction metrics are labelled with: the policy as configured."""
        return self.label or self.text()

    @property
    def num_recent(self) -> int:
        """H2O: the most recent entries every compaction keeps."""
        return self.recent or self.budget // 4

    @property
    def salt(self) -> str | None:
        """What the policy adds to a request's prefix-cache salt (None: its published blocks
        are exact, so it shares the ordinary chain)."""
        return None if self.compacts else f"kv_retention={self.text()}"

    def validate(
        self,
        block_size: int,
        windowed_layers: bool = False,
        kv_format: str = "",
        entry_copy: bool = True,
    ) -> None:
        """Refuse what the engine cannot do, naming the field and the allowed range.
        ``windowed_layers``: the model has layers with their own sliding window;
        ``entry_copy``: the KV format (``kv_format``) can move single cache entries."""
        if self.kind in ("window", "sinks"):
            if not self.percent and self.window < block_size:
                raise _bad(
                    f"window must be at least the block size ({block_size}), got {self.window}"
                )
        if self.kind == "sinks" and self.sinks < 1:
            raise _bad(f"sinks must be >= 1 (the first tokens kept), got {self.sinks}")
        if self.compacts and not self.percent and self.budget < block_size:
            raise _bad(f"{self.kind}: the budget must be at least the block size ({block_size}), "
                       f"got {self.budget}")  # fmt: skip
        if self.kind == "snapkv":
            if not 1 <= self.obs <= 1024:
                raise _bad(f"obs: the observation window must be in [1, 1024], got {self.obs}")
            if not (1 <= self.kernel <= 63 and self.kernel % 2):
                raise _bad(f"kernel: the pooling width must be odd, in [1, 63], got "
                           f"{self.kernel}")  # fmt: skip
        if self.kind == "h2o" and not self.percent and self.recent >= self.budget:
            raise _bad(f"recent: must be below the budget ({self.budget}), got {self.recent}")
        if self.compacts and not entry_copy:
            raise _bad(f"{self.kind} with kv_cache_dtype {kv_format} is not supported (KIVI "
                       f"quantizes keys per channel over a block, so single entries cannot "
                       f"move); use auto, fp8 or int8")  # fmt: skip
        if windowed_layers and self.kind in ("sinks", "snapkv", "h2o"):
            raise _bad(f"{self.kind} on a model with its own sliding window is not supported "
                       f"(its window already bounds what each layer reads)")  # fmt: skip

    def for_prompt(self, num_prompt_tokens: int, block_size: int) -> RetentionSpec:
        """The policy with a prompt share resolved to tokens (at least one block)."""
        if not self.percent:
            return self
        kept = -(-num_prompt_tokens * self.percent // 100)
        if self.kind == "h2o":
            budget = max(block_size, kept)
            recent = min(self.recent, budget - 1)
            return RetentionSpec("h2o", budget=budget, recent=recent, label=self.text())
        if self.kind == "snapkv":  # the share counts the observation window
            return RetentionSpec("snapkv", budget=max(block_size, kept - self.obs), obs=self.obs,
                                 kernel=self.kernel, label=self.text())  # fmt: skip
        return RetentionSpec(self.kind, window=max(block_size, kept), sinks=self.sinks,
                             label=self.text())  # fmt: skip

    def compacts_prompt(self, num_prompt_tokens: int) -> bool:
        """Whether SnapKV has anything to drop from a prompt this long."""
        return self.kind == "snapkv" and num_prompt_tokens > self.budget + self.obs


def parse_retention(value: str | RetentionSpec | None) -> RetentionSpec | None:
    """None, a spec, or its text (``""`` and ``"none"`` mean no policy)."""
    if value is None or isinstance(value, RetentionSpec):
        return value
    if isinstance(value, str) and value.strip().lower() in ("", "none", "off"):
        return None
    return RetentionSpec.parse(value)
