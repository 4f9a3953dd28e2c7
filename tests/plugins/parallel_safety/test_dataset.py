"""The labelled safety set: what each split holds, and that the everyday set stays out of it."""

from __future__ import annotations

import pytest

from loopstack.plugins.parallel_safety.bench.dataset import (
    BENIGN,
    INJECTION,
    bipia_attacks,
    build_examples,
    everyday_items,
)
from tests.support import SHARED_DATA

pytestmark = pytest.mark.needs_data


@pytest.fixture(scope="module")
def examples():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA}; skipping")
    return build_examples(SHARED_DATA)


def test_bipia_test_attacks_only_ever_appear_in_the_test_split(examples):
    test_attacks = {a for a, _ in bipia_attacks(SHARED_DATA, "test")}
    for e in examples:
        if e.category == INJECTION and e.split != "test":
            assert e.payload not in test_attacks and not any(a in e.text for a in test_attacks)
    in_test = {e.payload for e in examples if e.split == "test" and e.attack.startswith("bipia")}
    assert in_test == test_attacks  # every test attack string is measured


def test_every_content_has_benign_calibration_sources_and_injected_payloads_are_known(examples):
    for content in ("user", "tool", "output"):
        sources = {e.source for e in examples if e.content == content and e.category == BENIGN
                   and e.split == "calibration"}
        assert len(sources) >= 3, content
    injected = [e for e in examples if e.category == INJECTION and e.source != "ipi-coding-agent"]
    assert injected and all(e.payload and e.payload in e.text for e in injected)


def test_the_everyday_set_is_never_part_of_the_labelled_set(examples):
    everyday = {item.text for item in everyday_items()}
    assert len(everyday) >= 300
    assert not everyday & {e.text for e in examples}


def test_the_set_is_deterministic():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA}; skipping")
    assert build_examples(SHARED_DATA)[:50] == build_examples(SHARED_DATA)[:50]


def test_agentdojo_records_fill_their_vectors_and_its_attacks_are_test_only(examples):
    import re

    from loopstack.plugins.parallel_safety.bench import agentdojo
    from loopstack.plugins.parallel_safety.bench.dataset import _inspect_evals_dir

    root = _inspect_evals_dir()
    if root is None:
        pytest.skip("inspect-evals is not installed (make install installs it data-only)")
    records, defaults = agentdojo.records(root)
    assert len(records) > 100 and {r.suite for r in records} == set(agentdojo.SUITES)
    carrying = [r for r in records if r.vectors]
    assert carrying
    for record in carrying:
        benign = agentdojo.fill(record, defaults[record.suite])
        assert not any("{" + name + "}" in benign for name in record.vectors)
    for suite in agentdojo.SUITES:
        goals = agentdojo.goals(root, suite)
        assert goals and not any(re.search(r"\{_?[A-Z_]+\}", g) for g in goals), suite  # constants filled in
    injected = [e for e in examples if e.attack.startswith("agentdojo/")]
    assert injected and all(e.split == "test" and "<INFORMATION>" in e.text and e.payload in e.text for e in injected)
    benign = {e.text for e in examples if e.source == "agentdojo-record" and e.category == BENIGN}
    assert benign and not any("<INFORMATION>" in t for t in benign)


def test_a_source_with_its_own_generator_leaves_every_other_sample_as_it_was(examples, monkeypatch):
    from loopstack.plugins.parallel_safety.bench import dataset

    monkeypatch.setattr(dataset, "cpp_headers", lambda *args, **kwargs: [])
    without = build_examples(SHARED_DATA)
    assert "cpp-header" in dataset.OWN_GENERATOR and not any(e.source == "cpp-header" for e in without)
    assert [e for e in examples if e.source != "cpp-header"] == without


def test_cpp_headers_start_after_their_licence_comment_and_skip_generated_op_headers(tmp_path):
    from loopstack.plugins.parallel_safety.bench.dataset import cpp_headers

    body = "#ifndef X_H\n#define X_H 1\n" + "extern int x_value(int);\n" * 12 + "#endif\n"
    (tmp_path / "x.h").write_text("/* Copyright (C) 1991 The Authors.\n   Licence text.  */\n// more\n\n" + body)
    (tmp_path / "short.h").write_text("/* only a comment */\n#define Y 1\n")
    (tmp_path / "ATen" / "ops").mkdir(parents=True)
    (tmp_path / "ATen" / "ops" / "add_ops.h").write_text(body)
    assert cpp_headers(root=tmp_path) == [body.strip()[:900]]
    assert cpp_headers(root=tmp_path / "absent") == []
    assert len(cpp_headers()) > 1000  # the pinned torch's own headers
