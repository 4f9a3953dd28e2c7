"""Retrieval sets and tool catalogs from ``../shared/data`` for the ``tool-search`` bench.

Each retrieval set is a list of tools (as :class:`ToolDoc`) and (query, gold tool keys)
pairs; each catalog is a list of Responses function tools with their namespaces, for
counting schema tokens. File formats are read as published (BFCL and Gorilla eval files
are JSON Lines despite ``.json``).
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loopstack.plugins.tool_search.docs import parameter_text
from loopstack.plugins.tool_search.retrieval.index import ToolDoc
from loopstack.tools import ToolInfo

__all__ = [
    "CATALOGS", "RETRIEVAL_SETS", "Query", "RetrievalSet", "docker_registry", "github_mcp", "load_catalog",
    "load_retrieval_set", "metatool_catalog",
]


@dataclass(frozen=True)
class Query:
    text: str
    gold: frozenset[str]


@dataclass(frozen=True)
class RetrievalSet:
    name: str
    docs: list[ToolDoc]
    queries: list[Query]


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield json.loads(line)


# -- retrieval sets ----------------------------------------------------------------------

def metatool(root: Path) -> RetrievalSet:
    """MetaTool single-tool queries (``all_clean_data.csv``) over ``plugin_des.json`` (199 tools)."""
    described = json.loads((root / "metatool" / "plugin_des.json").read_text())
    docs = [ToolDoc(name, name, description=text) for name, text in described.items()]
    with (root / "metatool" / "all_clean_data.csv").open(encoding="utf-8", newline="") as handle:
        queries = [Query(row["Query"], frozenset([row["Tool"]])) for row in csv.DictReader(handle)]
    return RetrievalSet("metatool", docs, queries)


def metatool_multi(root: Path) -> RetrievalSet:
    """MetaTool two-tool queries (``multi_tool_query_golden.json``) over ``big_tool_des.json``."""
    described = json.loads((root / "metatool" / "big_tool_des.json").read_text())
    docs = [ToolDoc(name, name, description=text) for name, text in described.items()]
    rows = json.loads((root / "metatool" / "multi_tool_query_golden.json").read_text())
    return RetrievalSet("metatool_multi", docs, [Query(r["query"], frozenset(r["tool"])) for r in rows])


def _bfcl(root: Path, stem: str, name: str) -> RetrievalSet:
    """Every question of a BFCL file searched against the union of the file's functions."""
    functions: dict[str, dict[str, Any]] = {}
    entries = list(_jsonl(root / "bfcl" / f"{stem}.json"))
    for entry in entries:
        for function in entry["function"]:
            functions.setdefault(function["name"], function)
    answers = {a["id"]: a for a in _jsonl(root / "bfcl" / "possible_answer" / f"{stem}.json")}
    docs = [
        ToolDoc(fn["name"], fn["name"], description=fn.get("description", ""),
                parameters=parameter_text(fn.get("parameters")))
        for fn in functions.values()
    ]
    queries = []
    for entry in entries:
        text = " ".join(m["content"] for turn in entry["question"] for m in turn if m.get("role") == "user")
        gold = frozenset(key for call in answers[entry["id"]]["ground_truth"] for key in call)
        queries.append(Query(text, gold))
    return RetrievalSet(name, docs, queries)


def bfcl_multiple(root: Path) -> RetrievalSet:
    return _bfcl(root, "BFCL_v4_multiple", "bfcl_multiple")


def bfcl_live_multiple(root: Path) -> RetrievalSet:
    return _bfcl(root, "BFCL_v4_live_multiple", "bfcl_live_multiple")


_SPACE = re.compile(r"\s+")
_INSTRUCTION = re.compile(r"###Instruction:(.*?)###Output", re.DOTALL)


def _api_key(api_call: str) -> str:
    return _SPACE.sub("", api_call).replace('"', "'")


def _merge(first: ToolDoc, other: ToolDoc) -> ToolDoc:
    def join(a: str, b: str) -> str:
        return a if b in a else f"{a} {b}"

    return ToolDoc(first.key, first.name, first.namespace, join(first.title, other.title),
                   join(first.description, other.description), join(first.parameters, other.parameters))


def _gorilla(root: Path, api_file: str, eval_file: str, name: str) -> RetrievalSet:
    """Gorilla APIBench: each instruction searched against the hub's API list; the gold
    tool is the entry whose ``api_call`` the answer uses (whitespace and quotes ignored)."""
    docs: dict[str, ToolDoc] = {}
    for api in _jsonl(root / "gorilla_apibench" / api_file):
        key = _api_key(api["api_call"])
        arguments = api.get("api_arguments")
        doc = ToolDoc(
            key, str(api.get("api_name", "")), namespace=str(api.get("framework", "")),
            title=f"{api.get('domain', '')} {api.get('functionality', '')}",
            description=str(api.get("description", "")),
            parameters=arguments if isinstance(arguments, str) else json.dumps(arguments),
        )
        # the same call listed several times (TF Hub lists one model per task): one tool
        # whose text joins every listing
        docs[key] = _merge(docs[key], doc) if key in docs else doc
    queries = []
    for row in _jsonl(root / "gorilla_apibench" / eval_file):
        match = _INSTRUCTION.search(row["code"])
        key = _api_key(row.get("api_call") or "")
        if match and key in docs:
            queries.append(Query(match.group(1).strip(), frozenset([key])))
    return RetrievalSet(name, list(docs.values()), queries)


def gorilla_hf(root: Path) -> RetrievalSet:
    return _gorilla(root, "huggingface_api.jsonl", "huggingface_eval.json", "gorilla_hf")


def gorilla_tf(root: Path) -> RetrievalSet:
    return _gorilla(root, "tensorflowhub_api.jsonl", "tensorflow_eval.json", "gorilla_tf")


def gorilla_torch(root: Path) -> RetrievalSet:
    return _gorilla(root, "torchhub_api.jsonl", "torchhub_eval.json", "gorilla_torch")


RETRIEVAL_SETS = {
    "metatool": metatool,
    "metatool_multi": metatool_multi,
    "bfcl_multiple": bfcl_multiple,
    "bfcl_live_multiple": bfcl_live_multiple,
    "gorilla_hf": gorilla_hf,
    "gorilla_tf": gorilla_tf,
    "gorilla_torch": gorilla_torch,
}


def load_retrieval_set(name: str, root: Path) -> RetrievalSet:
    return RETRIEVAL_SETS[name](root)


# -- catalogs (for schema tokens and latency) --------------------------------------------

def github_mcp(root: Path) -> list[ToolInfo]:
    """The GitHub MCP server's 117 tools, namespace ``github``."""
    tools = json.loads((root / "github_mcp_tools" / "github_mcp_server_tools.json").read_text())
    return [ToolInfo(t["name"], t.get("description", ""), t.get("inputSchema") or {"type": "object", "properties": {}},
                     namespace="github") for t in tools]


def docker_registry(root: Path) -> list[ToolInfo]:
    """The Docker MCP registry: 4,938 tools of 240 servers (namespace = server). A name
    another tool already has becomes ``server__name`` (tool names must be unique)."""
    infos: list[ToolInfo] = []
    names: set[str] = set()
    for record in _jsonl(root / "docker_mcp_registry" / "docker_mcp_registry_tools.jsonl"):
        tool = record["tool"]
        properties = {
            arg["name"]: {"type": arg.get("type", "string"), "description": arg.get("desc", "")}
            for arg in tool.get("arguments") or () if isinstance(arg, dict) and arg.get("name")
        }
        name, n = tool["name"], 1
        while name in names:
            name, n = f"{record['server']}__{tool['name']}" + (f"__{n}" if n > 1 else ""), n + 1
        names.add(name)
        infos.append(ToolInfo(name, tool.get("description", ""), {"type": "object", "properties": properties},
                              namespace=record["server"]))
    return infos


def metatool_catalog(root: Path) -> list[ToolInfo]:
    """MetaTool's 199 tools (no parameters). They are remote plugins, like MCP servers' tools:
    namespace ``metatool``."""
    described = json.loads((root / "metatool" / "plugin_des.json").read_text())
    return [ToolInfo(name, text, namespace="metatool") for name, text in described.items()]


CATALOGS = {"github_mcp": github_mcp, "docker_registry": docker_registry, "metatool": metatool_catalog}


def load_catalog(name: str, root: Path) -> list[ToolInfo]:
    return CATALOGS[name](root)
