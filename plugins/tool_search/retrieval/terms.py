"""Text -> search terms: identifiers split into words, lowercased, stop words dropped, stemmed.

Tool names are identifiers (``getIssueComments``, ``list_pull_requests``, ``math.factorial``,
``send-sms``); queries are prose. Both go through :func:`terms` so that ``issues`` in a
question meets ``Issue`` in a name.
"""

from __future__ import annotations

import functools
import re

try:  # Snowball (Porter 2) English stemmer; the light stemmer below is the fallback
    import snowballstemmer
except ImportError:  # pragma: no cover - snowballstemmer is a dependency
    snowballstemmer = None

__all__ = ["STEMMER", "STOP_WORDS", "identifier_words", "light_stem", "normalize_name", "stem", "terms"]

# camelCase and PascalCase boundaries: "getHTTPResponse" -> get HTTP Response
_CAMEL_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_WORD = re.compile(r"[A-Za-z0-9]+")
_NOT_ALNUM = re.compile(r"[^a-z0-9]+")

STOP_WORDS = frozenset(
    ["a", "about", "an", "and", "any", "are", "as", "at", "be", "by", "can", "could", "do", "does", "for", "from", "get", "give", "how", "i", "if", "in", "into", "is", "it", "its", "me", "my", "of", "on", "or", "please", "should", "so", "some", "that", "the", "their", "them", "then", "there", "these", "this", "to", "us", "use", "using", "want", "was", "we", "what", "when", "where", "which", "who", "will", "with", "would", "you", "your"]
)


def identifier_words(text: str) -> list[str]:
    """Split ``text`` on anything not a letter or digit and on camelCase boundaries; lowercase.

    >>> identifier_words("getIssue_comments.v2-beta")
    ['get', 'issue', 'comments', 'v2', 'beta']
    """
    return [part.lower() for word in _WORD.findall(text) for part in _CAMEL_BOUNDARY.split(word) if part]


def light_stem(word: str) -> str:
    """A light suffix stripper (plural, -ing, -ed): "issues" -> "issue", "listing" -> "list"."""
    if len(word) <= 3 or word.isdigit():
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith("sses"):
        return word[:-2]
    if word.endswith("ing") and len(word) > 5:
        return word[:-3]
    if word.endswith("ed") and len(word) > 4:
        return word[:-2]
    if word.endswith("es") and word[-3:-2] in ("s", "x", "z", "h") and len(word) > 4:
        return word[:-2]
    if word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


_SNOWBALL = snowballstemmer.stemmer("english") if snowballstemmer is not None else None
STEMMER = "snowball-english" if _SNOWBALL is not None else "light"  # recorded beside bench figures


@functools.lru_cache(maxsize=200_000)
def stem(word: str) -> str:
    """``word``'s stem: Snowball English ("papers" -> "paper", "renting" -> "rent"), or
    :func:`light_stem` where snowballstemmer is not installed."""
    return _SNOWBALL.stemWord(word) if _SNOWBALL is not None else light_stem(word)


def terms(text: str) -> list[str]:
    """Search terms of ``text``, in order, with repeats (term frequency matters)."""
    return [stem(word) for word in identifier_words(text) if word not in STOP_WORDS]


def normalize_name(name: str) -> str:
    """A tool name reduced to lowercase letters and digits, for exact-name matching:
    ``create_issue``, ``createIssue`` and ``Create-Issue`` are all ``createissue``."""
    return _NOT_ALNUM.sub("", name.lower())
