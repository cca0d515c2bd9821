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

Planned, refused by name for now: ``snapkv:B`` and ``h2o:B``; the parser knows their syntax so
the error can say so.

Composition with prefix caching: a retaining request's K/V past the first W tokens depend on
the policy, so its blocks are hashed under a chain salted with the policy (requests with the
same policy share them; everyone else never sees them), and blocks it drops are released, never
changed in place. Every KV format works with ``window`` and ``sinks`` (dropping blocks is
format-agnostic).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.config import ConfigError

KINDS = ("window", "sinks", "snapkv", "h2o")
IMPLEMENTED = ("window", "sinks")
FIELD = "kv_retention"


def _bad(message: str) -> ConfigError:
    return ConfigError(f"{FIELD}: {message}")


@dataclass(frozen=True, slots=True)
class RetentionSpec:
    """A parsed ``--kv-retention`` value; ``kind`` is one of :data:`KINDS`."""

    kind: str
    window: int = 0  # window, sinks: recent tokens kept
    sinks: int = 0  # sinks: first tokens kept
    budget: int = 0  # snapkv, h2o: tokens kept
    obs: int = 32  # snapkv: observation window (queries that score the prompt)
    kernel: int = 7  # snapkv: pooling width over neighbouring keys
    recent: int = 0  # h2o: recent tokens always kept (0: budget // 4)
    # window given as a share of each prompt ("window:50%": 2x compression of the prompt);
    # resolved per request by :meth:`for_prompt`, which sets ``window``.
    percent: int = 0

    def text(self) -> str:
        if self.kind == "window":
            return f"window:{self.percent}%" if self.percent else f"window:{self.window}"
        if self.kind == "sinks":
            window = f"{self.percent}%" if self.percent else self.window
            return f"sinks:{self.sinks},window:{window}"
        extra = ""
        if self.kind == "snapkv" and (self.obs, self.kernel) != (32, 7):
            extra = f",obs:{self.obs},kernel:{self.kernel}"
        if self.kind == "h2o" and self.recent:
            extra = f",recent:{self.recent}"
        return f"{self.kind}:{self.budget}{extra}"

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
            if key == "window" and value.endswith("%"):
                try:
                    percent = int(value[:-1])
                except ValueError:
                    raise _bad(f"window: expected an integer percentage, got {value!r}") from None
                if not 1 <= percent <= 100:
                    raise _bad(f"window: a share of the prompt must be in [1%, 100%], got {value}")
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
                       kernel=parts.get("kernel", 7))  # fmt: skip
        else:
            spec = cls("h2o", budget=parts["h2o"], recent=parts.get("recent", 0))
        return spec

    @property
    def bounds_distance(self) -> bool:
        """Whether no query ever sees a key farther away than the policy's budget, so RoPE
        positions past the model's limit are harmless (a window and sinks both; whether the
        model still makes sense without sinks is the quality gate's question)."""
        return self.kind in ("window", "sinks")

    @property
    def salt(self) -> str:
        """What the policy adds to a request's prefix-cache salt."""
        return f"kv_retention={self.text()}"

    def validate(self, block_size: int) -> None:
        """Refuse what the engine cannot do, naming the field and the allowed range."""
        if self.kind not in IMPLEMENTED:
            raise _bad(
                f"{self.kind!r} is planned, not implemented yet; implemented: "
                f"{', '.join(IMPLEMENTED)} (e.g. 'window:512')"
            )
        if not self.percent and self.window < block_size:
            raise _bad(f"window must be at least the block size ({block_size}), got {self.window}")
        if self.kind == "sinks" and self.sinks < 1:
            raise _bad(f"sinks must be >= 1 (the first tokens kept), got {self.sinks}")

    def for_prompt(self, num_prompt_tokens: int, block_size: int) -> RetentionSpec:
        """The policy with a prompt share resolved to tokens (at least one block)."""
        if not self.percent:
            return self
        window = max(block_size, -(-num_prompt_tokens * self.percent // 100))
        return RetentionSpec(self.kind, window=window, sinks=self.sinks)


def parse_retention(value: str | RetentionSpec | None) -> RetentionSpec | None:
    """None, a spec, or its text (``""`` and ``"none"`` mean no policy)."""
    if value is None or isinstance(value, RetentionSpec):
        return value
    if isinstance(value, str) and value.strip().lower() in ("", "none", "off"):
        return None
    return RetentionSpec.parse(value)
