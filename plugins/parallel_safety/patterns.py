"""The pattern guard: known prompt-injection markers, matched by regular expressions.

Cheap (microseconds) and precise on what it knows: chat-template role tokens smuggled
into user or tool content, "ignore previous instructions" and its variants, fake
system/developer headers, and requests to reveal the system prompt.
"""

from __future__ import annotations

import re

from loopstack.plugins.parallel_safety.guard import Stage, Verdict

INJECTION_MARKERS: dict[str, str] = {
    "role_token": r"<\|im_start\|>\s*(system|assistant)|<\|(system|start_header_id)\|>|\[/?INST\]|<<SYS>>",
    "override": r"\b(ignore|disregard|forget|override)\b[^.\n]{0,40}\b(previous|prior|above|earlier|all|your)\b"
                r"[^.\n]{0,20}\b(instructions?|prompts?|rules|directives|guidelines)\b",
    "fake_header": r"(^|\n)\s*(#{2,}|\*\*\*|---)?\s*(new|updated|system|developer|admin)\s+"
                   r"(instructions?|prompt|message|override)\s*[:#]",
    "persona": r"\b(you are now|from now on,? you are|act as)\s+(DAN|an? unrestricted|an? unfiltered|developer mode)"
               r"|\bdeveloper mode (enabled|output)\b|\bjailbroken?\b",
    "prompt_leak": r"\b(reveal|repeat|print|show|output)\b[^.\n]{0,30}\b(system prompt|initial instructions|"
                   r"instructions you were given)\b",
}


class PatternGuard:
    """Blocks text containing a known injection marker; category ``injection_marker``."""

    name = "injection_patterns"
    stages = ("input", "output")

    def __init__(self, markers: dict[str, str] | None = None) -> None:
        self.markers = {k: re.compile(v, re.IGNORECASE) for k, v in (markers or INJECTION_MARKERS).items()}

    def find(self, text: str) -> str | None:
        """The name of the first marker found in ``text``, or None."""
        for marker, pattern in self.markers.items():
            if pattern.search(text):
                return marker
        return None

    async def check(self, text: str, *, stage: Stage) -> Verdict:
        marker = self.find(text)
        if marker is None:
            return Verdict.allow(self.name)
        return Verdict.block(self.name, "injection_marker", 1.0, marker)
