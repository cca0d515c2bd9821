"""Every engine setting is a field of the config dataclasses, and the flags and ``LLM(...)``'s
keywords are generated from those fields: the references here are ``dataclasses.fields``
walked by the test itself, and the flags, types and choices the CLI had before they were
generated."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import MISSING
from pathlib import Path

import pytest

import kvserve
from kvserve import LLM
from kvserve.cli import build_parser
from kvserve.config import (
    ADMISSION_POLICIES,
    DTYPES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
)
from kvserve.config_fields import UnknownSettingError, build_config
from kvserve.engine_args import add_engine_args, engine_kwargs
from kvserve.kv.formats import KV_CACHE_DTYPES
from kvserve.llm import engine_config

BUNDLED = str(Path(kvserve.__file__).parent / "bundled" / "kvserve-ref")

# The engine flags as they were written by hand before being generated: each keeps its name,
# and a typed one its type. (Flags added since are checked against the fields below.)
HAND_WRITTEN = {
    "--tokenizer": str, "--dtype": str, "--device": str, "--seed": int, "--block-size": int,
    "--max-num-seqs": int, "--max-num-batched-tokens": int, "--max-model-len": int,
    "--num-gpu-blocks": int, "--kv-cache-memory": str, "--kv-cache-dtype": str,
    "--calculate-kv-scales": bool, "--kv-cache-prefault": bool,
    "--disable-hybrid-kv-cache-manager": bool, "--kv-retention": str, "--kv-offload-cpu": str,
    "--kv-offloading-size": float, "--kv-offload-disk": str, "--kv-offload-disk-size": str,
    "--kv-offload-redis": str, "--kv-offload-redis-size": str, "--kv-offload-timeout": float,
    "--kv-offload-write-policy": str, "--kv-offload-reuse-threshold": int,
    "--preemption-mode": str, "--enable-prefix-caching": bool, "--enable-chunked-prefill": bool,
    "--scheduling-policy": str, "--admission": str, "--admission-watermark": float,
    "--workload-classes": str,
}  # fmt: skip
# Lengths and sizes now read vLLM's suffixes (32k, 32K) and byte units (2GiB) into an int.
LENGTHS = {"--max-num-batched-tokens", "--max-model-len"}
SIZES = {"--kv-cache-memory", "--kv-offload-cpu", "--kv-offload-disk-size",
         "--kv-offload-redis-size"}  # fmt: skip


def leaf_fields(cls: type = EngineConfig) -> dict[str, dataclasses.Field]:
    """The test's own walk: a field whose default is a dataclass is walked into, unless its
    metadata says it is given whole, as JSON."""
    out: dict[str, dataclasses.Field] = {}
    for f in dataclasses.fields(cls):
        factory = f.default_factory
        nested = isinstance(factory, type) and dataclasses.is_dataclass(factory)
        if nested and not f.metadata.get("json"):
            out.update(leaf_fields(factory))
        else:
            out[f.name] = f
    return out


def field_default(f: dataclasses.Field) -> object:
    return f.default if f.default is not MISSING else f.default_factory()


def flag_default(f: dataclasses.Field) -> object:
    """A setting given whole as JSON has no flag value unless the flag is given."""
    return None if f.metadata.get("json") else field_default(f)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def actions_by_dest(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in p._actions}


def test_every_field_is_a_flag_with_the_field_default():
    actions = actions_by_dest(parser())
    fields = leaf_fields()
    assert set(fields) - {"model"} <= set(actions)
    for name, f in fields.items():
        if name == "model":
            continue
        action = actions[name]
        flag = f.metadata.get("flag") or "--" + name.replace("_", "-")
        assert flag in action.option_strings, name
        assert action.default == flag_default(f), name
        assert f.metadata.get("help"), f"{name}: no help text"
    # --model is resolved (the bundled model when none is given), so its flag defaults to None
    assert actions["model"].default is None


def test_hand_written_flags_keep_their_names_types_and_choices():
    p = parser()
    by_flag = {s: a for a in p._actions for s in a.option_strings}
    assert set(HAND_WRITTEN) <= set(by_flag)
    for flag, kind in HAND_WRITTEN.items():
        a = by_flag[flag]
        if kind is bool:
            assert a.nargs == 0, flag
        elif flag in LENGTHS:
            assert (a.type("2048"), a.type("2k"), a.type("2K")) == (2048, 2000, 2048), flag
        elif flag in SIZES:
            assert (a.type("2GiB"), a.type("2GB"), a.type("512")) == (2 << 30, 2 * 10**9, 512)
        else:
            assert (a.type or str) is kind, flag
    # BooleanOptionalAction where it was: the switches that are on by default
    for name in ("enable-prefix-caching", "enable-chunked-prefill"):
        assert f"--no-{name}" in by_flag
    assert tuple(by_flag["--kv-cache-dtype"].choices) == KV_CACHE_DTYPES
    assert tuple(by_flag["--dtype"].choices) == DTYPES
    assert tuple(by_flag["--admission"].choices) == ADMISSION_POLICIES
    args = p.parse_args(
        ["--block-size", "32", "--no-enable-prefix-caching", "--kv-cache-dtype", "int8",
         "--calculate-kv-scales", "--kv-offload-timeout", "1.5", "--admission-watermark", "0.2",
         "--max-model-len", "512", "--kv-cache-memory", "2GiB", "--model", "kvserve-ref"]
    )  # fmt: skip
    kw = engine_kwargs(args)
    assert kw["model"] == BUNDLED
    assert (kw["block_size"], kw["enable_prefix_caching"], kw["kv_cache_dtype"]) == (
        32,
        False,
        "int8",
    )
    assert (kw["calculate_kv_scales"], kw["kv_offload_timeout"]) == (True, 1.5)
    assert (kw["admission_watermark"], kw["max_model_len"]) == (0.2, 512)
    assert kw["kv_cache_memory"] == 2 * 2**30
    cfg = engine_config(**kw)
    assert (cfg.cache.block_size, cfg.cache.kv_cache_memory) == (32, 2 * 2**30)
    assert (cfg.scheduler.max_model_len, cfg.cache.enable_prefix_caching) == (512, False)


@pytest.mark.parametrize("argv", [["--kv-cache-dtype", "fp4"], ["--dtype", "int4"],
                                  ["--block-size", "x"], ["--admission", "lazy"]])  # fmt: skip
def test_bad_flag_values_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_llm_keywords_are_the_fields():
    fields = leaf_fields()
    # Every field, given its own default, is accepted and builds the default config.
    defaults = {n: field_default(f) for n, f in fields.items() if n != "model"}
    assert engine_config("m", **defaults) == EngineConfig("m")
    # Each keyword reaches the field of its config.
    routed = engine_config(
        "m", block_size=32, kv_offload_cpu="1GiB", max_num_seqs=3, lpm_max_skips=5,
        hold_prefix_followers=False, dtype="float32", seed=7, kv_retention="window:64",
    )  # fmt: skip
    assert routed.cache == CacheConfig(block_size=32, kv_offload_cpu="1GiB",
                                       kv_retention="window:64")  # fmt: skip
    assert routed.scheduler == SchedulerConfig(max_num_seqs=3, lpm_max_skips=5,
                                               hold_prefix_followers=False)  # fmt: skip
    assert (routed.dtype, routed.seed, routed.model) == ("float32", 7, "m")
    # The flags' keywords are the same set, so `kvserve` and LLM(...) take the same settings.
    kw = engine_kwargs(parser().parse_args([]))
    assert set(kw) == set(fields)


def test_unknown_keyword_is_refused_naming_it():
    with pytest.raises(ConfigError, match="blok_size: unknown engine argument; did you mean "
                                          "'block_size'"):  # fmt: skip
        engine_config("m", blok_size=16)
    # A TypeError too, as Python's own for an unexpected keyword; and LLM refuses it before it
    # looks for the model.
    with pytest.raises(TypeError, match="kv_cache_type"):
        LLM("/nonexistent/model", kv_cache_type="int8")
    with pytest.raises(UnknownSettingError, match="cache: unknown"):
        engine_config("m", cache=CacheConfig())  # nested configs are walked, not keywords


def test_help_shows_each_default():
    root, _ = build_parser()
    serve = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    text = serve.choices["serve"].format_help()
    # One chunk per option: from a line starting "  -" to the next.
    chunks = [" ".join(c.split()) for c in re.split(r"\n(?=  -)", text)]
    for name, f in leaf_fields().items():
        if name == "model":
            assert any(c.startswith("--model") and "(default: kvserve-ref)" in c for c in chunks)
            continue
        flag = f.metadata.get("flag") or "--" + name.replace("_", "-")
        (chunk,) = [c for c in chunks if re.match(rf"{re.escape(flag)}[ ,]", c)]
        assert f"(default: {flag_default(f)})" in chunk, chunk


def test_a_new_field_becomes_a_flag_and_a_keyword():
    """A field added to a nested config (with its metadata) is a flag with its default and a
    keyword, with no other change."""
    sched = dataclasses.make_dataclass(
        "SchedulerConfigPlus",
        [("queue_slack", int, dataclasses.field(default=7, metadata={"help": "slack"}))],
        bases=(SchedulerConfig,),
        slots=True,
    )
    engine = dataclasses.make_dataclass(
        "EngineConfigPlus",
        [("scheduler", sched, dataclasses.field(default_factory=sched))],
        bases=(EngineConfig,),
        slots=True,
    )
    p = argparse.ArgumentParser()
    add_engine_args(p, engine)
    assert "--queue-slack" in p.format_help() and "slack (default: 7)" in p.format_help()
    kw = engine_kwargs(p.parse_args(["--queue-slack", "9", "--max-num-seqs", "4"]), engine)
    cfg = build_config(engine, **kw)
    assert (cfg.scheduler.queue_slack, cfg.scheduler.max_num_seqs) == (9, 4)
    assert build_config(engine, model="m").scheduler.queue_slack == 7
