"""Embed a search's query while the model is still writing the call.

A hybrid search spends most of its time on the query's MiniLM forward (6 to 13 ms on a
2-core CPU). The query is known before the call is complete: the server streams a call's
arguments as the model writes them (``response.function_call_arguments.delta``), and the
model still has to write the call's last tokens (``"limit"``, the closing braces,
``</tool_call>``) after the query's closing quote. :func:`streamed_query` finds the
complete ``query`` string in the arguments so far; the plugin's
``loopstack_tool_call_delta`` hook then embeds it on the search thread
(:meth:`.catalog.CatalogIndex.embed_query`), and the search, queued behind it on that
thread, finds the vector in the embedder's query cache.
"""

from __future__ import annotations

import json
import re

__all__ = ["streamed_query"]

# "query": "<a complete JSON string>" as a key of the arguments object (after "{" or ",")
_QUERY = re.compile(r'(?:^|[{,])\s*"query"\s*:\s*("(?:[^"\\]|\\.)*")')


def streamed_query(arguments: str) -> str | None:
    """The ``query`` argument once the model has written all of it, else None.

    ``arguments`` is the call's text so far (usually not yet valid JSON).

    Example:
        >>> streamed_query('{"query": "open an iss')
        >>> streamed_query('{"query": "open an issue", "li')
        'open an issue'
    """
    match = _QUERY.search(arguments)
    if match is None:
        return None
    try:
        value = json.loads(match.group(1))
    except ValueError:
        return None
    return value if isinstance(value, str) else None
