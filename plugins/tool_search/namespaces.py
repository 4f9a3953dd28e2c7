"""The ``tool_search`` tool's description: what it does and one short line per namespace."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from loopstack.plugins.tool_search.retrieval.terms import STOP_WORDS, identifier_words
from loopstack.tools import ToolInfo

__all__ = ["LOCAL_NAMESPACE", "namespace_counts", "namespace_lines", "search_tool_description"]

LOCAL_NAMESPACE = "local"  # how tools without a namespace are listed

_PREAMBLE = (
    "Search the tools that are available on demand and load the best matches; the tools it "
    "returns can be called like any other from then on. Search by what you want to do "
    "(\"create a github issue\") or by a tool name. Namespaces:"
)


def namespace_counts(infos: Sequence[ToolInfo]) -> Counter[str]:
    """Namespace -> number of tools, in first-seen order."""
    return Counter(info.namespace or LOCAL_NAMESPACE for info in infos)


def _hint(infos: Sequence[ToolInfo], num_words: int) -> str:
    # the words that name the most tools of this namespace: "issue, pull, request, file"
    counts = Counter(w for info in infos for w in dict.fromkeys(identifier_words(info.name)) if w not in STOP_WORDS)
    return ", ".join(word for word, _ in counts.most_common(num_words))


def namespace_lines(infos: Sequence[ToolInfo], *, max_hinted: int = 32, hint_words: int = 4) -> list[str]:
    """One line per namespace: ``- github (117 tools: issue, pull, request, file)``.

    Past ``max_hinted`` namespaces the hint words are dropped (``- github (117 tools)``):
    a registry of hundreds of servers must still cost little up front.
    """
    counts = namespace_counts(infos)
    by_namespace: dict[str, list[ToolInfo]] = {}
    for info in infos:
        by_namespace.setdefault(info.namespace or LOCAL_NAMESPACE, []).append(info)
    lines = []
    for namespace, count in counts.items():
        noun = "tool" if count == 1 else "tools"
        hint = _hint(by_namespace[namespace], hint_words) if len(counts) <= max_hinted else ""
        lines.append(f"- {namespace} ({count} {noun}: {hint})" if hint else f"- {namespace} ({count} {noun})")
    return lines


def search_tool_description(infos: Sequence[ToolInfo], *, max_hinted: int = 32) -> str:
    """The full description of ``tool_search`` for the deferred ``infos``."""
    return "\n".join([_PREAMBLE, *namespace_lines(infos, max_hinted=max_hinted)])
