"""One grammar for every command: the model positionally or as ``--model``; lengths and sizes
with suffixes (vLLM's ``32k``/``32K``, ``4GiB``); ``--help`` that shows a help line and the
default of every flag; and a vLLM flag or ``LLM(...)`` keyword kvserve lacks answered with
what to use instead. The references are written here: vLLM's suffix rule and its flag names
(read from vLLM's source), and each command's ``--help`` text parsed against argparse's
defaults."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

import kvserve
from kvserve import LLM
from kvserve.cli import build_parser, main
from kvserve.config_fields import UnknownSettingError, settings_of
from kvserve.engine_args import engine_kwargs, model_arg
from kvserve.vllm_args import (
    NOT_APPLICABLE,
    PLANNED,
    UNSUPPORTED,
    USE,
    VLLM_ONLY_ARGS,
    VLLMArg,
    vllm_flag,
)

BUNDLED = str(Path(kvserve.__file__).parent / "bundled" / "kvserve-ref")
COMMANDS = ["generate", "serve", "bench", "bench compare", "plan", "quality", "simulate",
            "tune", "download"]  # fmt: skip
MODEL_COMMANDS = ["generate", "serve", "bench", "plan", "quality", "simulate", "tune", "download"]


def subparsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by name ("bench compare" included)."""
    root, _ = build_parser()
    out: dict[str, argparse.ArgumentParser] = {}

    def walk(p: argparse.ArgumentParser, prefix: str) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a._name_parser_map.items():
                    out[f"{prefix}{name}"] = sub
                    walk(sub, f"{prefix}{name} ")

    walk(root, "")
    return out


def help_text(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([*command.split(), "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def help_entries(text: str) -> dict[str, str]:
    """Each argument's help as ``--help`` prints it, by its first option string (or its
    metavar for a positional): an entry starts on a line indented two spaces, the invocation
    ends at two spaces, and the help runs on over the lines indented deeper (a group's title
    at column 0 ends it)."""
    out = {}
    for chunk in re.split(r"\n(?=  \S)", text):
        if not chunk.startswith("  "):
            continue
        first, *rest = chunk.split("\n")
        invocation, _, help_start = first[2:].partition("  ")
        more = [line.strip() for line in rest if line.startswith(" ")]
        out[re.split(r"[ ,]", invocation)[0]] = " ".join([help_start.strip(), *more]).strip()
    return out


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_a_line_and_the_default_of_every_flag(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    entries = help_entries(help_text(command, capsys))
    parser = subparsers()[command]
    checked = 0
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        key = action.option_strings[0] if action.option_strings else (
            action.metavar or action.dest
        ).split(" ")[0]  # fmt: skip
        assert key in entries, f"{command}: {key} not in --help"
        words = entries[key]
        assert len(words.split()) >= 2, f"{command} {key}: no help line ({words!r})"
        if action.default not in (None, argparse.SUPPRESS):
            # wrapping may break a long default at a hyphen: compare without whitespace
            shown = "".join(words.split())
            want = f"(default:{str(action.default).replace(' ', '')})"
            assert want in shown, f"{command} {key}: {want} not in {words!r}"
            checked += 1
    assert checked > 0 or command in ("bench compare", "download")


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_every_command_takes_the_model_positionally_or_as_a_flag(command):
    model = "smollm2" if command == "download" else "some-model"
    parser = subparsers()[command]
    for argv in ([model], ["--model", model], [model, "--model", model]):
        args = parser.parse_args(argv)
        assert model_arg(args) == model, argv
    assert model_arg(parser.parse_args([])) is None


@pytest.mark.parametrize("command", [c for c in MODEL_COMMANDS if c != "download"])
def test_two_different_models_are_an_error_naming_both(command, capsys):
    a, b = "model-a", "model-b"  # (download has one name to choose from)
    assert main([command, a, "--model", b]) == 2
    err = capsys.readouterr().err
    assert f"MODEL ('{a}')" in err and f"--model ('{b}')" in err


def test_plan_takes_model_as_a_flag_as_it_does_positionally(capsys):
    """plan refused --model; now both forms plan the same model to the same figures."""
    outs = []
    for argv in (["kvserve-ref"], ["--model", "kvserve-ref"]):
        assert main(["plan", *argv, "--context", "2k", "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert outs[0] == outs[1]
    assert outs[0]["model"] == BUNDLED and outs[0]["context"] == 2000


def test_bench_positional_model_beside_its_compare_subcommand():
    parser = subparsers()["bench"]
    args = parser.parse_args(["--num-prompts", "3", "kvserve-ref", "--max-model-len", "1K"])
    assert (model_arg(args), args.num_prompts, args.max_model_len) == ("kvserve-ref", 3, 1024)
    assert engine_kwargs(args)["model"] == BUNDLED
    args = parser.parse_args(["compare", "a.json", "b.json", "--markdown"])
    assert (args.bench_command, args.files, args.markdown) == ("compare", ["a.json", "b.json"],
                                                               True)  # fmt: skip
    assert model_arg(args) is None


# vLLM's human_readable_int (vllm/engine/arg_utils.py at 99d7eb5d, the type of its
# --max-model-len, --max-num-batched-tokens, --kv-cache-memory-bytes): k m g t are powers of
# 1000 (a decimal allowed), K M G T powers of 1024 (whole numbers only).
VLLM_LENGTHS = {"4096": 4096, "32k": 32_000, "32K": 32_768, "128K": 131_072, "1M": 1_048_576,
                "1m": 1_000_000, "1.5k": 1_500, "25.6k": 25_600, "2g": 2 * 10**9}  # fmt: skip
BAD_LENGTHS = ["1.5K", "32q", "k", "-5", "3.2"]
LENGTH_FLAGS = [("serve", "--max-model-len"), ("serve", "--max-num-batched-tokens"),
                ("plan", "--context"), ("bench", "--input-len"), ("bench", "--output-len"),
                ("bench", "--prefix-len"), ("generate", "--max-tokens")]  # fmt: skip
# Sizes as kvserve.config.parse_bytes reads them: IEC units (GiB, Gi) are powers of 1024, SI
# ones (GB, G) powers of 1000.
SIZES = {"4GiB": 4 * 2**30, "4Gi": 4 * 2**30, "512MiB": 512 * 2**20, "4GB": 4 * 10**9,
         "4G": 4 * 10**9, "1.5GB": 1_500_000_000, "2048": 2048}  # fmt: skip
BAD_SIZES = ["4XB", "0", "lots", "4gb"]
SIZE_FLAGS = [("serve", "--kv-cache-memory"), ("serve", "--kv-offload-cpu"),
              ("serve", "--kv-offload-disk-size"), ("serve", "--kv-offload-redis-size"),
              ("serve", "--max-body-bytes"), ("plan", "--validate-memory")]  # fmt: skip


def _dest(parser: argparse.ArgumentParser, flag: str) -> str:
    return next(a.dest for a in parser._actions if flag in a.option_strings)


@pytest.mark.parametrize("command, flag", LENGTH_FLAGS)
def test_length_flags_read_vllms_suffixes(command, flag, capsys):
    parser = subparsers()[command]
    dest = _dest(parser, flag)
    for text, tokens in VLLM_LENGTHS.items():
        assert getattr(parser.parse_args([flag, text]), dest) == tokens, text
    for text in BAD_LENGTHS:
        with pytest.raises(SystemExit):
            parser.parse_args([flag, text])
        err = capsys.readouterr().err
        assert f"argument {flag}:" in err and "32k (32,000)" in err and "32K (32,768)" in err


@pytest.mark.parametrize("command, flag", SIZE_FLAGS)
def test_size_flags_read_byte_units(command, flag, capsys):
    parser = subparsers()[command]
    dest = _dest(parser, flag)
    for text, nbytes in SIZES.items():
        assert getattr(parser.parse_args([flag, text]), dest) == nbytes, text
    for text in BAD_SIZES:
        with pytest.raises(SystemExit):
            parser.parse_args([flag, text])
        err = capsys.readouterr().err
        assert f"argument {flag}:" in err and "4GiB" in err and "4GB" in err


def test_tune_search_reads_lengths_as_the_flags_do():
    from kvserve.sim.space import parse_search

    assert parse_search(["max_num_batched_tokens=2048,8k,8K"]) == {
        "max_num_batched_tokens": (2048, 8000, 8192)
    }
    with pytest.raises(ValueError, match="search: max_num_batched_tokens: expected a token"):
        parse_search(["max_num_batched_tokens=8.5K"])


# Common flags of `vllm serve` that kvserve does not take, read from vLLM's source:
# vllm/engine/arg_utils.py (EngineArgs.add_cli_args, at 99d7eb5d) and
# vllm/entrypoints/openai/cli_args.py (FrontendArgs, at 00522333). Each must get an answer
# naming what to use instead, not "unrecognized arguments". (The hub flags --revision,
# --download-dir and --hf-token belong with hub model ids and are left out here.)
VLLM_FLAGS_KVSERVE_LACKS = [
    "--kv-cache-memory-bytes", "--num-gpu-blocks-override",
    "--swap-space", "--cpu-offload-gb", "--kv-offloading-backend",
    "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp",
    "--enable-expert-parallel", "--compilation-config", "--quantization",
    "-q", "--trust-remote-code", "--tokenizer-mode", "--load-format", "--max-logprobs",
    "--enable-lora", "--max-loras", "--max-lora-rank", "--speculative-config",
    "--limit-mm-per-prompt", "--prefix-caching-hash-algo",
    "--disable-sliding-window", "--long-prefill-token-threshold",
    "--max-num-partial-prefills", "--structured-outputs-config", "--reasoning-parser",
    "--uvicorn-log-level", "--disable-uvicorn-access-log", "--ssl-keyfile", "--ssl-certfile",
    "--ssl-ca-certs", "--allowed-origins", "--allow-credentials", "--allowed-methods",
    "--allowed-headers", "--root-path", "--uds", "--chat-template",
    "--lora-modules", "--middleware",
    "--api-server-count", "--response-role", "--return-tokens-as-token-ids",
    "--enable-prompt-tokens-details",
]  # fmt: skip
# vLLM flags kvserve takes under the same name (the same list's other half).
VLLM_FLAGS_KVSERVE_HAS = [
    "--async-scheduling", "--model", "--tokenizer", "--dtype", "--seed", "--max-model-len",
    "--block-size",
    "--kv-cache-dtype", "--enable-prefix-caching", "--calculate-kv-scales",
    "--max-num-seqs", "--max-num-batched-tokens", "--enable-chunked-prefill",
    "--scheduling-policy", "--disable-hybrid-kv-cache-manager", "--kv-transfer-config",
    "--kv-events-config",
    "--distributed-executor-backend", "--tensor-parallel-size", "-tp", "--attention-backend",
    "--kv-offloading-size",
    "--host", "--port", "--api-key", "--served-model-name",
    "--enable-auto-tool-choice", "--tool-call-parser", "--gpu-memory-utilization",
    "--enforce-eager",
]  # fmt: skip


def serve_options() -> set[str]:
    return {o for a in subparsers()["serve"]._actions for o in a.option_strings}


def test_the_table_covers_vllms_common_flags_and_names_real_equivalents():
    options = serve_options()
    assert set(VLLM_FLAGS_KVSERVE_HAS) <= options
    for flag in VLLM_FLAGS_KVSERVE_LACKS:
        assert flag not in options, f"{flag}: kvserve has it; drop it from the table"
        assert vllm_flag(flag) is not None, f"{flag}: not in kvserve.vllm_args"
    settings = settings_of()
    for entry in VLLM_ONLY_ARGS.values():
        assert entry.flag not in options
        if entry.use is not None:
            assert entry.use in options, f"{entry.flag}: {entry.use} is no kvserve flag"
            if entry.engine and entry.kind in (USE, PLANNED):  # LLM(...) gets it as a keyword
                assert entry.use.removeprefix("--").replace("-", "_") in settings
        assert entry.keyword not in settings


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["serve", "--data-parallel-size", "2"],
         "--data-parallel-size is not supported by kvserve: data parallelism is replicas: run "
         "several `kvserve serve` behind `kvserve router`"),
        (["generate", "--swap-space=4"],
         "--swap-space is not supported by kvserve; use --kv-offload-cpu"),
        (["bench", "kvserve-ref", "--compilation-config={}"],
         "--compilation-config is not supported by kvserve; use --cuda-graph-sizes"),
        (["serve", "--trust-remote-code"], "--trust-remote-code is not applicable to kvserve"),
        (["serve", "--uvicorn-log-level", "debug"],
         "--uvicorn-log-level is not supported by kvserve; use --log-level"),
    ],
)  # fmt: skip
def test_a_vllm_flag_kvserve_lacks_says_what_to_use(argv, expected, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"kvserve {argv[0]}: error: {expected}" in err
    assert "unrecognized arguments" not in err


def test_an_unknown_flag_is_still_argparses_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--frobnicate"])
    assert e.value.code == 2
    assert "unrecognized arguments: --frobnicate" in capsys.readouterr().err


def test_every_kind_of_answer_is_in_the_table():
    kinds = {e.kind for e in VLLM_ONLY_ARGS.values()}
    assert {USE, UNSUPPORTED, NOT_APPLICABLE} <= kinds
    # none is planned now; an entry that is says what, and what serves meanwhile
    planned = VLLMArg("--some-flag", PLANNED, "the default", use="--other-flag",
                      planned="doing it")  # fmt: skip
    assert planned.flag_message() == (
        "--some-flag is planned (doing it) and not supported by kvserve yet; use "
        "--other-flag (the default)"
    )


@pytest.mark.parametrize(
    "kwargs, must",
    [
        ({"compilation_config": {}}, ["compilation_config", "cuda_graph_sizes="]),
        ({"data_parallel_size": 2}, ["data_parallel_size", "`kvserve router`"]),
        ({"swap_space": 4}, ["swap_space", "kv_offload_cpu="]),
        ({"max_num_seq": 8}, ["max_num_seq", "did you mean 'max_num_seqs'"]),
        ({"kv_cache_memory_bytes": 2**30}, ["kv_cache_memory=", "'kv_cache_memory'"]),
    ],
)  # fmt: skip
def test_llm_refuses_an_unknown_keyword_naming_it_and_the_way_out(kwargs, must):
    with pytest.raises(UnknownSettingError) as e:
        LLM("/nonexistent/model", **kwargs)
    assert isinstance(e.value, TypeError)  # as Python's own unexpected-keyword error
    text = str(e.value)
    for part in must:
        assert part in text, text
    assert "engine_config()" not in text and "__init__" not in text
