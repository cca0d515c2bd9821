"""The generated reference pages: the committed ones are what the code generates now, a setting
or metric added without regenerating them is reported by name, and every flag argparse itself
prints in a command's usage is on the configuration page."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
from prometheus_client import Counter, Gauge

from kvserve.cli import build_parser
from kvserve.config import EngineConfig, SchedulerConfig
from kvserve.docs_reference import PAGES, check, check_page, write
from kvserve.docs_reference.configuration import configuration_page
from kvserve.docs_reference.metrics import documentation_registry, metrics_page

REPO = Path(__file__).resolve().parent.parent
CONFIG_PAGE = "docs/reference/configuration.md"
METRICS_PAGE = "docs/reference/metrics.md"


def committed(rel: str) -> str:
    return (REPO / rel).read_text(encoding="utf-8")


def first_cells(page: str) -> set[str]:
    """The first cell of every table row, code fences removed, split at ', ' (a switch's
    row names both its forms)."""
    out = set()
    for line in page.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            cell = line[2:].split(" | ", 1)[0]
            out.update(part.strip().strip("`") for part in cell.split(", "))
    return out


def test_committed_pages_are_what_the_code_generates():
    problems = check(REPO)
    assert problems == [], "\n".join(problems)


def test_write_then_check_round_trips(tmp_path):
    assert {str(p.relative_to(tmp_path)) for p in write(tmp_path)} == set(PAGES)
    assert check(tmp_path) == []
    (tmp_path / METRICS_PAGE).unlink()
    assert check(tmp_path) == [f"{METRICS_PAGE}: missing; write it with "
                               "`python -m kvserve.docs_reference`"]  # fmt: skip


def _with_setting(name: str, **metadata: object) -> type:
    """EngineConfig whose scheduler config has one more field, as a developer would add it."""
    field = dataclasses.field(default=4, metadata=metadata)
    sched = dataclasses.make_dataclass("SchedulerConfig", [(name, int, field)],
                                       bases=(SchedulerConfig,), slots=True)  # fmt: skip
    nested = dataclasses.field(default_factory=sched)
    return dataclasses.make_dataclass("EngineConfig", [("scheduler", sched, nested)],
                                      bases=(EngineConfig,), slots=True)  # fmt: skip


def test_a_setting_added_without_regenerating_is_reported_by_its_flag():
    config = _with_setting("max_num_widgets", help="widgets in one step at most")
    generated = configuration_page(config)
    assert "--max-num-widgets" in generated and "--max-num-widgets" not in committed(CONFIG_PAGE)
    problems = check_page(CONFIG_PAGE, committed(CONFIG_PAGE), generated)
    assert [p for p in problems if p.endswith("missing or different: --max-num-widgets")]
    # Nothing else of the engine table is reported: the comparison names the one row.
    assert not [p for p in problems if "--max-num-seqs" in p]


def test_a_changed_default_is_reported_by_its_flag():
    from kvserve.config_fields import settings_of

    def parser() -> argparse.ArgumentParser:
        p, _ = build_parser()
        serve = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        port = next(a for a in serve.choices["serve"]._actions if a.dest == "port")
        port.default = 9000
        return p

    generated = configuration_page(EngineConfig, parser)
    problems = check_page(CONFIG_PAGE, committed(CONFIG_PAGE), generated)
    assert any(p.endswith("missing or different: --port") for p in problems), problems
    assert any(p.endswith("not in the code (or different): --port") for p in problems)
    assert settings_of(EngineConfig)["max_num_seqs"].default == 256  # the real one untouched


def test_a_metric_added_without_regenerating_is_reported_by_its_name():
    def registry(stats):
        r = documentation_registry(stats)
        Gauge("kvserve:widgets_in_flight", "Widgets in flight.", ["widget"],
              registry=r).labels("a").set(1)  # fmt: skip
        return r

    generated = metrics_page(registry)
    assert "`widget`" in generated  # its label is read from the registry
    problems = check_page(METRICS_PAGE, committed(METRICS_PAGE), generated)
    assert [p for p in problems if p.endswith("missing or different: kvserve:widgets_in_flight")]
    assert len(problems) == 1, problems


def test_a_labelled_metric_with_no_sample_is_refused_by_name():
    """Its labels would be unknown, so the generator names it instead of guessing."""

    def registry(stats):
        r = documentation_registry(stats)
        Counter("kvserve:widgets", "Widgets.", ["widget"], registry=r)
        return r

    with pytest.raises(ValueError, match="kvserve:widgets: no sample"):
        metrics_page(registry)


def _commands(p: argparse.ArgumentParser, name: str = "kvserve"):
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub, sp in a.choices.items():
                yield f"{name} {sub}", sp
                yield from _commands(sp, f"{name} {sub}")


def test_every_flag_in_each_commands_usage_is_on_the_page():
    """argparse's own usage line lists every option a command takes: each must be a row of
    the page (the engine flags once, in the engine table)."""
    page_flags = first_cells(committed(CONFIG_PAGE))
    parser, _ = build_parser()
    commands = list(_commands(parser))
    assert {name for name, _ in commands} >= {
        "kvserve generate", "kvserve serve", "kvserve bench", "kvserve bench compare",
        "kvserve plan", "kvserve simulate", "kvserve tune", "kvserve quality", "kvserve download",
    }  # fmt: skip
    for name, p in commands:
        usage = p.format_usage()
        flags = set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", usage)) - {"--help"}
        assert flags, name
        missing = sorted(flags - page_flags)
        assert not missing, f"{name}: {missing} not on {CONFIG_PAGE}"
        assert f"### {name}\n" in committed(CONFIG_PAGE) or name == "kvserve serve"


READS = re.compile(
    r'\benvs\.([A-Z][A-Z0-9_]*)\b|(?:os\.environ\.get|os\.getenv|getenv)\(\s*"([A-Z][A-Z0-9_]*)"'
)


def test_every_environment_variable_read_is_on_the_page():
    """Each variable the code reads (``envs.NAME`` in Python, ``getenv("NAME")`` in the C
    kernels, or ``os.environ`` directly), found in the source text, is a row of the page."""
    read = set()
    for folder in ("kvserve", "benchmarks", "scripts"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".c", ".h"):
                text = path.read_text(encoding="utf-8")
                read |= {a or b for a, b in READS.findall(text)}
    read -= {"VARIABLES", "NATIVE_VARIABLES", "NAME"}  # envs' own tables; its docstring's NAME
    assert {"KVSERVE_DISABLE_AMX", "KVSERVE_QUANT_SCALAR", "CC"} <= read  # the search works
    rows = first_cells(committed(CONFIG_PAGE))
    assert read <= rows, sorted(read - rows)
