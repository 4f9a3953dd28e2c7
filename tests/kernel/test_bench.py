from __future__ import annotations

import importlib.util
import json

import anyio
import pytest

from loopstack import StackLoader
from loopstack.bench import BenchOptions, Workload, run_bench
from loopstack.bench.registry import workloads
from loopstack.bench.report import format_table
from loopstack.cli.main import main


class OrderRecorder(Workload):
    name = "order"
    description = "records the order columns run in"
    default_steps = 4

    def __init__(self):
        self.order = []

    async def step(self, column, index):
        self.order.append(column)
        return {"value": 2.0 if column == "second" else 1.0, f"only_{column}": 1.0}


def test_runner_alternates_and_computes_ratios(catalog, write_stack):
    loader = StackLoader(catalog)
    stacks = [loader.load(write_stack("first", "")), loader.load(write_stack("second", ""))]
    workload = OrderRecorder()
    result = anyio.run(lambda: run_bench(workload, stacks, BenchOptions(), progress=False))
    assert workload.order == ["first", "second", "second", "first"] * 2
    assert result.columns == ["first", "second"]
    assert result.metrics["value"] == {"first": 1.0, "second": 2.0}
    assert result.ratios["value"] == 2.0
    assert result.ratios["only_first"] is None  # missing in the last column: no ratio
    payload = result.to_json()
    assert set(payload) == {"workload", "columns", "metrics", "ratios", "pair_ratios", "config", "rounds"}
    assert payload["config"]["steps"] == 4 and payload["pair_ratios"] == {}
    assert payload["rounds"]["value"] == {"first": [1.0] * 4, "second": [2.0] * 4}  # every round kept
    assert payload["rounds"]["only_second"] == {"second": [1.0] * 4}


def test_a_workloads_own_ratio_pairs_are_computed_and_printed(catalog, write_stack):
    class Paired(OrderRecorder):
        def ratio_pairs(self, columns):
            return [("second", "first")]

    loader = StackLoader(catalog)
    stacks = [loader.load(write_stack("first", "")), loader.load(write_stack("second", ""))]
    result = anyio.run(lambda: run_bench(Paired(), stacks, BenchOptions(steps=2), progress=False))
    assert result.pair_ratios == {"second/first": {"only_first": None, "only_second": None, "value": 2.0}}
    lines = format_table(result).splitlines()  # "workload: ...", the header, a rule, the metrics
    assert lines[1].split()[-1] == "second/first"
    assert next(line for line in lines if line.startswith("value")).split()[-1] == "2"


def test_same_stack_twice_gets_unique_columns(catalog):
    stack = StackLoader(catalog).load("baseline")
    assert OrderRecorder().columns([stack, stack]) == ["baseline", "baseline#2"]


def test_kernel_workload_is_registered(catalog):
    assert "kernel" in workloads(catalog)


def test_cli_bench_writes_json_in_the_documented_shape(tmp_path, capsys):
    out = tmp_path / "kernel.json"
    code = main(["bench", "--workload", "kernel", "--stack", "baseline", "--stack", "full",
                 "--quick", "--no-progress", "--json", str(out), "--no-plot"])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["workload"] == "kernel" and data["columns"] == ["baseline", "full"]
    assert set(data["metrics"]["request_overhead_us"]) == {"baseline", "full"}
    assert data["metrics"]["request_overhead_us"]["baseline"] > 0
    assert "request_overhead_us" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="the plot needs matplotlib (bench extra)")
def test_cli_bench_puts_its_plot_beside_the_json_and_nowhere_else(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out" / "kernel.json"
    assert main(["bench", "--workload", "kernel", "--quick", "--no-progress", "--json", str(out)]) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["kernel.json", "kernel.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no docs/results/ made in the working dir


def test_cli_bench_writes_no_plot_unasked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--workload", "kernel", "--quick", "--no-progress"]) == 0
    assert list(tmp_path.iterdir()) == []


def test_cli_bench_unknown_workload(capsys):

    with pytest.raises(SystemExit, match=r"unknown workload 'nope'; available: (\w[\w-]*, )*engine, (\w[\w-]*, )*kernel"):
        main(["bench", "--workload", "nope"])


def test_workloads_come_from_the_discovery_hook_and_names_are_unique(catalog):
    import types

    from loopstack import hookimpl

    module = types.ModuleType("extra_workloads")

    @hookimpl
    def loopstack_bench_workloads():
        return [OrderRecorder()]

    module.loopstack_bench_workloads = loopstack_bench_workloads
    catalog.discovery.register(module, name="extra_workloads")
    assert isinstance(workloads(catalog)["order"], OrderRecorder)
    clone = types.ModuleType("clone_workloads")
    clone.loopstack_bench_workloads = loopstack_bench_workloads
    catalog.discovery.register(clone, name="clone_workloads")
    with pytest.raises(ValueError, match="two workloads are named 'order'"):
        workloads(catalog)


def test_cli_bench_option_must_be_key_value():
    with pytest.raises(SystemExit, match="--option takes KEY=VALUE"):
        main(["bench", "--workload", "kernel", "--option", "turns"])


def test_an_option_names_a_subset_in_its_own_order():
    from loopstack.bench.workload import BenchOptionError, named_subset

    allowed = ("off", "ngram", "suffix")
    assert named_subset({}, "columns", allowed) == ["off", "ngram", "suffix"]
    assert named_subset({"columns": "suffix, off"}, "columns", allowed) == ["suffix", "off"]
    with pytest.raises(BenchOptionError, match=r"unknown column\(s\) draft in -o columns; expected some of off, ngram"):
        named_subset({"columns": "off,draft"}, "columns", allowed, noun="column")
    with pytest.raises(BenchOptionError, match="none given"):
        named_subset({"columns": " , "}, "columns", allowed)
