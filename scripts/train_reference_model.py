"""Train kvserve's bundled long-context reference model (a few-million-parameter Llama) on CPU.

Why this recipe: a model this small, trained for about an hour on one core, sees ~11 M tokens,
far too few to learn retrieval from natural text alone. Retrieval needs an induction (copy)
circuit, which forms only after a loss plateau whose length grows with the context length and
with the tokens per step. So training starts on 64-token sequences at 512 tokens per step (many
small updates) made of dense key/value documents (kv_doc: pass-code statements, about half of
them restated or asked about later, so a quarter of all positions carry a retrieval loss), then a
curriculum doubles the context up to 2,048 tokens. The formats are the quality gate's own
(kvserve/quality/tasks.py): natural-text haystack sentences with pass-code needles, multi-turn
chats with facts stated early and asked later. Answer tokens carry extra loss weight; the random
digits of a statement carry none (they cannot be predicted). float32, because bf16 autocast runs
at about half the speed on a CPU without AMX.

  python scripts/train_reference_model.py --out models/kvserve-ref   # the committed model
  python scripts/train_reference_model.py --resume ...               # continue after a stop
  python scripts/train_reference_model.py --verify   # our Llama == transformers' (logits)

The model code matches Hugging Face Llama exactly (RMSNorm in float32, rotate_half RoPE, SwiGLU,
GQA), so the saved safetensors load in ``transformers`` and in the kvserve engine unchanged.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvserve.model.resolve import bundled_model_dir  # noqa: E402
from kvserve.quality import tasks as T  # noqa: E402


@dataclass
class ModelArgs:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    intermediate_size: int = 704
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096


# ---------------------------------------------------------------- model (HF Llama math)
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.h, self.kv = a.num_attention_heads, a.num_key_value_heads
        self.hd = a.hidden_size // self.h
        self.q_proj = nn.Linear(a.hidden_size, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, a.hidden_size, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(self.h // self.kv, dim=1)
        v = v.repeat_interleave(self.h // self.kv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn, self.mlp = Attention(a), MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class Llama(nn.Module):
    """Parameter names equal HF ``LlamaForCausalLM``'s; the LM head is tied to the embedding."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args, self.model = a, Backbone(a)
        hd = a.hidden_size // a.num_attention_heads
        inv = 1.0 / (a.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        self.register_buffer("inv_freq", inv, persistent=False)
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scale = 1 / math.sqrt(2 * a.num_hidden_layers) if "o_proj" in name else 1.0
                scale = scale if "down_proj" not in name else 1 / math.sqrt(2 * a.num_hidden_layers)
                nn.init.normal_(p, std=std * scale)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], dtype=torch.float32)
        emb = torch.outer(pos, self.inv_freq)
        emb = torch.cat((emb, emb), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return F.linear(self.model.norm(x), self.model.embed_tokens.weight)


# ---------------------------------------------------------------- tokenizer
def train_tokenizer(vocab_size: int, seed: int):
    """Byte-level BPE, digits split one per token so any number is copyable digit by digit."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    special = [T.PAD, T.BOS, T.EOS, *T.ROLE_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    rng = random.Random(seed)
    synth = [
        T.needle_sentence(f"{a} {n}", T.random_code(rng))
        for a in T.ADJECTIVES
        for n in T.NOUNS[::7]
    ]
    synth += [T.needle_question(T.random_key(rng)) + " 1." for _ in range(2000)]
    synth += [T.var_question(n) + f" VAR {n} = 1." for n in T.NOUNS] * 10
    synth += [T.render_chat([{"role": "user", "content": T.REMEMBER + T.PASSAGE}])] * 500
    tok.train_from_iterator(list(T.haystack_sentences("train")) + synth, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{T.BOS} $A", pair=f"{T.BOS} $A {T.BOS} $B", special_tokens=[(T.BOS, 1)]
    )
    return tok


# ---------------------------------------------------------------- data
class Doc:
    """Token ids plus a per-token loss weight (the weight of predicting that token)."""

    def __init__(self, tok, enc_cache):
        self.tok, self.cache, self.ids, self.w = tok, enc_cache, [], []
        self.hay_pos = -1

    def sentence(self, rng: random.Random, hay: list[str]) -> str:
        """Haystack sentences run consecutively from a random start, as in the gate's prompts."""
        if self.hay_pos < 0:
            self.hay_pos = rng.randrange(len(hay))
        self.hay_pos += 1
        return hay[self.hay_pos % len(hay)]

    def add(self, text: str, weight: float = 1.0):
        ids = self.cache.get(text) or self.tok.encode(text, add_special_tokens=False).ids
        self.ids += ids
        self.w += [weight] * len(ids)

    def add_statement(self, text: str, code: str):
        """A sentence containing a fresh random code: its digits are unpredictable, weight 0."""
        before, after = text.split(code)
        self.add(before)
        self.add(code, 0.0)
        self.add(after)


W_ANS = 4.0  # answer-token loss weight (text tokens weigh 1)
EARLY_AT_START = 0.33  # early_doc: share that states the needle first (phase 7 ran with 0)
W_REP = 2.0  # repeated-span weight in repeat_doc


def needle_doc(d: Doc, rng: random.Random, n: int, hay: list[str]):
    """Haystack sentences with needles stated and queried at every distance. The density is
    drawn per document, from one needle per page of text to almost pure key/value recall."""
    densities = [(0.03, 0.03), (0.1, 0.1), (0.2, 0.25), (0.35, 0.45)]
    short_dense = DENSE_SHORT and n <= 257
    p_need, p_q = rng.choice(densities[2:] if short_dense else densities)
    stated: list[tuple[str, str]] = []
    used: set[str] = set()
    first = True
    while len(d.ids) < n:
        r = rng.random()
        if r < p_need or (first and rng.random() < 0.15):
            near = rng.choice(stated)[0] if stated and rng.random() < 0.3 else None
            key = T.distinct_keys(rng, 1, near=near)[0] if near else T.random_key(rng)
            if key in used:
                continue
            used.add(key)
            code = T.random_code(rng)
            stated.append((key, code))
            d.add_statement(("" if first else " ") + T.needle_sentence(key, code), code)
        elif r < p_need + p_q and stated:
            key, code = rng.choice(stated)
            d.add(T.needle_question(key))
            d.add(" " + code, W_ANS)
            d.add(".\n")
        else:
            s = d.sentence(rng, hay)
            d.add(s if first else " " + s)
        first = False


def early_doc(d: Doc, rng: random.Random, n: int, hay: list[str]):
    """One needle in the first 15 % of the text, asked at the very end, with a few distractor
    needles between: the gate's hardest cells (depth 0-10 % of the longest context), where
    needle_doc's uniformly drawn questions rarely reach."""
    key, code = T.random_key(rng), T.random_code(rng)
    # A third of them open with the needle (depth 0, right after BOS: the weakest cell).
    at = 0 if rng.random() < EARLY_AT_START else int(n * rng.uniform(0, 0.15))
    used, stated, first = {key}, False, True
    while True:
        if not stated and len(d.ids) >= at:
            d.add_statement(("" if first else " ") + T.needle_sentence(key, code), code)
            stated = True
        elif stated and rng.random() < 0.02:
            other = T.random_key(rng)
            if other not in used:
                used.add(other)
                c = T.random_code(rng)
                d.add_statement(" " + T.needle_sentence(other, c), c)
        else:
            s = d.sentence(rng, hay)
            s = s if first else " " + s
            if len(d.ids) + len(d.cache.get(s) or ()) > n - 24:  # room for the question
                break
            d.add(s)
        first = False
    if not stated:
        d.add_statement(" " + T.needle_sentence(key, code), code)
    d.add(T.needle_question(key))
    d.add(" " + code, W_ANS)
    d.add(".\n")
    while len(d.ids) < n:
        d.add(" " + d.sentence(rng, hay))


def kv_doc(d: Doc, rng: random.Random, n: int, hay: list[str]):
    """Dense key/value recall, the start of the curriculum: pass-code statements of which about
    half restate or ask for an earlier key, so a quarter of all positions carry a retrieval loss
    (in needle_doc, long haystack sentences dilute it tenfold)."""
    stated: list[tuple[str, str]] = []
    while len(d.ids) < n:
        r, lead = rng.random(), " " if stated else ""
        if stated and r < 0.45:
            key, code = rng.choice(stated)
            if rng.random() < 0.5:
                d.add(lead + f"The pass code for {key} is")
                d.add(" " + code, W_ANS)
                d.add(".")
            else:
                d.add(T.needle_question(key))
                d.add(" " + code, W_ANS)
                d.add(".\n")
        elif r < 0.9 or not stated:
            near = rng.choice(stated)[0] if stated and rng.random() < 0.3 else None
            key = T.distinct_keys(rng, 1, near=near)[0] if near else T.random_key(rng)
            if any(k == key for k, _ in stated):
                continue
            code = T.random_code(rng)
            stated.append((key, code))
            d.add_statement(lead + T.needle_sentence(key, code), code)
        else:
            d.add(lead + d.sentence(rng, hay))


def var_doc(d: Doc, rng: random.Random, n: int, hay: list[str]):
    """Variable chains of 0-3 hops stated in order among text, then queried."""
    names = rng.sample(T.NOUNS, len(T.NOUNS))
    pending: list[str] = []  # statements of the chain in progress
    cur = ("", "")
    done: list[tuple[str, str]] = []  # (last name, answer)
    while len(d.ids) < n:
        r = rng.random()
        if r < 0.25 and not pending and len(names) >= 4:
            hops = rng.randint(0, 3)
            sents, last, ans = T.var_chain(rng, hops, [names.pop() for _ in range(hops + 1)])
            d.add_statement(" " + sents[0], ans.split()[-1])
            pending, cur = sents[1:], (last, ans)
            if not pending:
                done.append(cur)
        elif r < 0.45 and pending:
            d.add(" " + pending.pop(0))
            if not pending:
                done.append(cur)
        elif r < 0.6 and done:
            last, ans = rng.choice(done)
            d.add(T.var_question(last))
            d.add(ans, W_ANS)
            d.add(".\n")
        else:
            d.add(" " + d.sentence(rng, hay))


def chat_doc(d: Doc, rng: random.Random, n: int, hay: list[str]):
    """Packed conversations: facts stated in user turns, passages, questions about earlier
    facts answered by the assistant."""
    while len(d.ids) < n:
        d.add(T.BOS)
        facts: list[tuple[str, str]] = []
        for turn in range(rng.randint(3, 12)):
            r = rng.random()
            if turn == 0 or r < 0.3:
                key, code = T.random_key(rng), T.random_code(rng)
                if any(k == key for k, _ in facts):
                    continue
                facts.append((key, code))
                d.add("<|user|>\n")
                d.add_statement(T.REMEMBER + T.needle_sentence(key, code), code)
                d.add("<|end|>\n<|assistant|>\nNoted.<|end|>\n")
            elif r < 0.6 and turn >= 2:
                key, code = rng.choice(facts)
                d.add(f"<|user|>\nWhat is the pass code for {key}?<|end|>\n<|assistant|>\n")
                d.add(f"The pass code for {key} is")
                d.add(" " + code, W_ANS)
                d.add(".<|end|>\n")
            else:
                i, k = rng.randrange(len(hay)), rng.randint(1, 12)
                passage = " ".join(hay[(i + j) % len(hay)] for j in range(k))
                d.add(
                    "<|user|>\n" + T.PASSAGE + passage + "<|end|>\n<|assistant|>\nNoted.<|end|>\n"
                )


def repeat_doc(d: Doc, rng: random.Random, n: int, hay: list[str]):
    """Spans of random words, repeated later: the cheapest way to grow induction (copy) heads,
    the circuit that every retrieval task here relies on. First copies are unpredictable
    (weight 0); repeats carry the loss."""
    spans: list[str] = []
    while len(d.ids) < n:
        r = rng.random()
        if r < 0.3 or not spans:
            words = [rng.choice(d.sentence(rng, hay).split()) for _ in range(rng.randint(3, 30))]
            spans.append(" " + " ".join(words))
            d.add(spans[-1], 0.0)
        elif r < 0.7:
            d.add(rng.choice(spans), W_REP)
        else:
            d.add(" " + d.sentence(rng, hay))


def copy_doc(d: Doc, rng: random.Random, n: int, hay: list[str]):
    """Random token spans, each repeated right away: the purest induction signal (a 6-layer
    model learns it in ~100 steps), used to start training before the circuits are needed."""
    while len(d.ids) < n:
        span = [
            rng.randrange(len(T.ROLE_TOKENS) + 3, d.tok.get_vocab_size())
            for _ in range(rng.randint(8, 48))
        ]
        d.ids += span + span
        d.w += [0.0] * len(span) + [W_REP] * len(span)


def text_doc(d: Doc, rng: random.Random, n: int, hay: list[str]):
    i = rng.randrange(len(hay))
    d.add(hay[i])
    while len(d.ids) < n:
        i += 1
        d.add(" " + hay[i % len(hay)])


# The mixes of the committed model: dense key/value recall while the copy circuit forms on short
# sequences, then mostly the gate's own shapes (a needle in a long haystack, multi-turn chats).
# var_doc and text_doc stay available for pilots (--mix).
MIX = [(kv_doc, 0.6), (needle_doc, 0.15), (repeat_doc, 0.1), (chat_doc, 0.15)]
MIX_LONG = [(kv_doc, 0.2), (needle_doc, 0.45), (repeat_doc, 0.15), (chat_doc, 0.2)]
LONG_FROM = 256  # sequence length from which MIX_LONG applies
# Phase 2 (--haystack-mix): the gate's own shape at every length, one needle per page of text
# included, because phase 1 teaches recall among dense statements but not across long text.
MIX_HAYSTACK = [(kv_doc, 0.1), (needle_doc, 0.35), (repeat_doc, 0.35), (chat_doc, 0.2)]
DENSE_SHORT = True  # short needle_doc sequences are dense (phase 1)
DOC_KINDS = {
    f.__name__: f
    for f in (kv_doc, needle_doc, early_doc, var_doc, chat_doc, repeat_doc, copy_doc, text_doc)
}


def parse_mix(spec: str) -> list[tuple]:
    """``"repeat_doc:0.7,kv_doc:0.3"`` -> [(repeat_doc, 0.7), (kv_doc, 0.3)]."""
    mix = []
    for part in spec.split(","):
        name, _, weight = part.partition(":")
        if name not in DOC_KINDS:
            raise ValueError(f"--mix: unknown document kind {name!r}; allowed: {sorted(DOC_KINDS)}")
        try:
            w = float(weight)
        except ValueError:
            msg = f"--mix: weight of {name} must be a number > 0, got {weight!r}"
            raise ValueError(msg) from None
        if not w > 0:
            raise ValueError(f"--mix: weight of {name} must be > 0, got {w}")
        mix.append((DOC_KINDS[name], w))
    return mix


def parse_stop_when(spec: str) -> tuple[str, float]:
    """``"repeat_doc:0.6"`` -> ("repeat_doc", 0.6)."""
    name, _, value = spec.partition(":")
    if name not in DOC_KINDS:
        msg = f"--stop-when: unknown document kind {name!r}; allowed: {sorted(DOC_KINDS)}"
        raise ValueError(msg)
    try:
        acc = float(value)
    except ValueError:
        msg = f"--stop-when: accuracy must be a number in (0, 1], got {value!r}"
        raise ValueError(msg) from None
    if not 0 < acc <= 1:
        raise ValueError(f"--stop-when: accuracy must be in (0, 1], got {acc}")
    return name, acc


def make_batch(tok, cache, hay, rng: random.Random, batch: int, seq_len: int, mix=None):
    ids, ws, kinds = [], [], []
    mix = mix or MIX
    for _ in range(batch):
        fn = rng.choices([f for f, _ in mix], weights=[w for _, w in mix])[0]
        d = Doc(tok, cache)
        if fn is not chat_doc:
            d.add(T.BOS, 0.0)
        fn(d, rng, seq_len + 1, hay)
        ids.append(d.ids[: seq_len + 1])
        ws.append(d.w[: seq_len + 1])
        kinds.append(fn.__name__)
    return torch.tensor(ids), torch.tensor(ws), kinds


# ---------------------------------------------------------------- export / verify
def export_hf(model: Llama, tok, out: Path, extra_card: str | None = None):
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    a = model.args
    sd = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    bos, eos, pad = (tok.token_to_id(t) for t in (T.BOS, T.EOS, T.PAD))
    end = tok.token_to_id("<|end|>")
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **asdict(a),
        "head_dim": a.hidden_size // a.num_attention_heads,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": bos, "eos_token_id": [eos, end], "pad_token_id": pad}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": T.BOS, "eos_token": T.EOS, "pad_token": T.PAD}
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "additional_special_tokens": list(T.ROLE_TOKENS),
        "model_max_length": a.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": T.CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    stm = {**specials, "additional_special_tokens": list(T.ROLE_TOKENS)}
    (out / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")


def verify_against_transformers(model: Llama, tok, path: Path) -> float:
    """Max |logit difference| between our model and transformers on a random input."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(
        0, model.args.vocab_size, (2, 300), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ours, theirs = model.eval()(ids), hf(ids).logits
    model.train()
    return (ours - theirs).abs().max().item()


# ---------------------------------------------------------------- training
def curriculum(spec: str) -> list[tuple[int, float]]:
    """``"64:0.3,128:0.7"`` -> [(seq_len, share of the steps)], shares normalised."""
    try:
        stages = [(int(a), float(b)) for a, b in (s.split(":") for s in spec.split(","))]
    except ValueError:
        raise ValueError(f"--curriculum: expected LEN:SHARE,..., got {spec!r}") from None
    if any(n < 2 or f <= 0 for n, f in stages):
        raise ValueError(f"--curriculum: lengths must be >= 2 and shares > 0, got {spec!r}")
    total = sum(f for _, f in stages)
    return [(n, f / total) for n, f in stages]


def seq_len_at(stages, frac: float) -> int:
    acc = 0.0
    for n, f in stages:
        acc += f
        if frac < acc:
            return n
    return stages[-1][0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(bundled_model_dir()), help="default: the bundled model")
    ap.add_argument("--work-dir", default="/tmp/kvserve-ref-work", help="checkpoints, log")
    ap.add_argument("--steps", type=int, default=16000)
    ap.add_argument("--tokens-per-step", type=int, default=512)
    ap.add_argument("--curriculum", default="64:0.3,128:0.2,256:0.15,512:0.15,1024:0.1,2048:0.1")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument(
        "--text-ramp",
        type=int,
        default=1,
        help="steps over which the loss weight "
        "of plain text rises from 0.05 to 1 (retrieval circuits form first)",
    )
    ap.add_argument("--copy-steps", type=int, default=0, help="steps with extra copy_doc data")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="bf16 autocast (about half the speed of float32 on a CPU without AMX)",
    )
    ap.add_argument(
        "--flush-denormal",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="treat subnormal floats as zero: a trained model's forward + backward at 2,048 "
        "tokens ran 1.85x slower with them (0.90 vs 0.49 s); the model card's runs before v4 "
        "kept them (--no-flush-denormal)",
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--ckpt-every", type=float, default=60.0, help="seconds")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument(
        "--init-from",
        default=None,
        help="start from another run's ckpt.pt, or from an exported model directory "
        "(its model.safetensors and tokenizer.json, e.g. models/kvserve-ref)",
    )
    ap.add_argument("--stop-after", type=int, default=None, help="stop (and export) at this step")
    ap.add_argument(
        "--stop-when",
        default=None,
        help="KIND:ACC, stop (and export) at the first log line whose running answer accuracy "
        "for that document kind reaches ACC (e.g. repeat_doc:0.6: the induction head formed)",
    )
    ap.add_argument(
        "--haystack-mix", action="store_true", help="phase 2 data mix (see MIX_HAYSTACK)"
    )
    ap.add_argument("--mix", default=None, help="one fixed mix at every length, KIND:WEIGHT,...")
    ap.add_argument("--verify", action="store_true", help="only check logits vs transformers")
    args = ap.parse_args(argv)
    try:
        stages = curriculum(args.curriculum)
        fixed_mix = parse_mix(args.mix) if args.mix else None
        stop_when = parse_stop_when(args.stop_when) if args.stop_when else None
    except ValueError as e:
        ap.error(str(e))
    if args.stop_after is not None and not 1 <= args.stop_after <= args.steps:
        ap.error(f"--stop-after must be in [1, --steps={args.steps}], got {args.stop_after}")
    if args.init_from and not (
        Path(args.init_from).is_file() or (Path(args.init_from) / "model.safetensors").is_file()
    ):
        ap.error(f"--init-from: no ckpt.pt file or model directory at {args.init_from}")

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(args.flush_denormal)
    global DENSE_SHORT
    DENSE_SHORT = not args.haystack_mix
    torch.manual_seed(args.seed)
    work, out = Path(args.work_dir), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    tok_path = work / "tokenizer.json"
    from tokenizers import Tokenizer

    init_dir = Path(args.init_from) if args.init_from and Path(args.init_from).is_dir() else None
    if init_dir is not None and not tok_path.exists():  # the weights' own tokenizer
        shutil.copyfile(init_dir / "tokenizer.json", tok_path)

    if tok_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
    else:
        tok = train_tokenizer(args.vocab, args.seed)
        tok.save(str(tok_path))
    margs = ModelArgs(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        intermediate_size=args.intermediate,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
    )
    model = Llama(margs)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f} M  vocab {margs.vocab_size}", flush=True)
    if args.verify:
        vdir = work / "verify"
        export_hf(model, tok, vdir)
        diff = verify_against_transformers(model, tok, vdir)
        print(f"max |logits - transformers| = {diff:.2e}")
        return 0 if diff < 1e-4 else 1

    hay = list(T.haystack_sentences("train"))
    cache = {}
    for s in hay:  # pre-encode haystack sentences (with and without leading space)
        for t in (s, " " + s):
            cache[t] = tok.encode(t, add_special_tokens=False).ids
    for t in (T.BOS, "<|end|>\n<|assistant|>\nNoted.<|end|>\n", ".\n"):
        cache[t] = tok.encode(t, add_special_tokens=False).ids

    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    step, elapsed, history, tokens = 0, 0.0, [], 0
    ckpt = work / "ckpt.pt"
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        tokens = state["tokens"]
        print(f"resumed at step {step} ({elapsed / 60:.1f} min)", flush=True)
    elif init_dir is not None:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(init_dir / "model.safetensors")))
        print(f"initialised from {init_dir}", flush=True)
    elif args.init_from:
        model.load_state_dict(torch.load(args.init_from, weights_only=False)["model"])
        print(f"initialised from {args.init_from}", flush=True)

    def save():
        tmp = work / "ckpt.tmp"
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "elapsed": elapsed,
                "history": history,
                "tokens": tokens,
                "args": vars(args),
            },
            tmp,
        )
        os.replace(tmp, ckpt)

    last_ckpt, t_log, acc, tok_since = time.time(), time.time(), {}, 0
    model.train()
    last_step = min(args.steps, args.stop_after or args.steps)
    while step < last_step:
        t0 = time.time()
        frac = step / args.steps
        seq_len = seq_len_at(stages, frac)
        batch = max(1, args.tokens_per_step // seq_len)
        rng = random.Random(args.seed * 1_000_003 + step)
        mix = MIX if seq_len < LONG_FROM else MIX_LONG
        mix = MIX_HAYSTACK if args.haystack_mix else mix
        mix = fixed_mix or mix
        mix = mix if step >= args.copy_steps else [(copy_doc, 0.5), *mix]
        ids, w, kinds = make_batch(tok, cache, hay, rng, batch, seq_len, mix)
        if step < args.warmup:
            lr = args.lr * (step + 1) / args.warmup
        else:
            p = (step - args.warmup) / max(1, args.steps - args.warmup)
            lr = args.lr * (
                args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p))
            )
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(ids[:, :-1])
        tgt, wt = ids[:, 1:], w[:, 1:]
        text_w = 0.05 + 0.95 * min(1.0, step / max(1, args.text_ramp))
        wt = torch.where(wt == 1.0, text_w, wt)
        nll = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none"
        )
        nll = nll.view_as(wt)
        loss = (nll * wt).sum() / wt.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        step += 1
        tokens += batch * seq_len
        tok_since += batch * seq_len
        elapsed += time.time() - t0
        with torch.no_grad():  # running stats: text loss, answer loss/accuracy per doc kind
            correct = logits.argmax(-1) == tgt
            ans = wt > 1.0
            txt = (wt > 0) & (wt <= 1.0)
            for i, k in enumerate(kinds):
                a = acc.setdefault(k, [0.0, 0, 0.0])
                a[0] += correct[i][ans[i]].float().sum().item()
                a[1] += int(ans[i].sum())
            a = acc.setdefault("text", [0.0, 0, 0.0])
            a[0] += (nll * txt).sum().item()
            a[1] += int(txt.sum())
            a = acc.setdefault("ans_nll", [0.0, 0, 0.0])
            a[0] += (nll * ans).sum().item()
            a[1] += int(ans.sum())
        if step % args.log_every == 0 or step == last_step:
            rec = {
                "step": step,
                "seq_len": seq_len,
                "tokens": tokens,
                "min": round(elapsed / 60, 2),
                "lr": round(lr, 6),
                "loss": round(loss.item(), 4),
                "gnorm": round(gnorm, 3),
            }
            rec.update({k: round(s / max(n, 1), 4) for k, (s, n, _) in acc.items()})
            rec["tok_s"] = round(tok_since / max(time.time() - t_log, 1e-6))
            history.append(rec)
            print(json.dumps(rec), flush=True)
            acc, t_log, tok_since = {}, time.time(), 0
            if stop_when and rec.get(stop_when[0], 0.0) >= stop_when[1]:
                print(f"--stop-when {args.stop_when} reached at step {step}", flush=True)
                break
        if time.time() - last_ckpt > args.ckpt_every:
            save()
            last_ckpt = time.time()
    save()
    model.eval()
    export_hf(model, tok, out)
    (work / "history.json").write_text(json.dumps(history))
    diff = verify_against_transformers(model, tok, out)
    print(
        f"exported to {out}; max |logits - transformers| = {diff:.2e}; {elapsed / 60:.1f} min",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
