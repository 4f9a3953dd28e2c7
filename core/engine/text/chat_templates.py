"""Chat templates for GGUF files that carry none (``tokenizer.chat_template`` absent).

Gemma 3's turn format: ``<start_of_turn>user\\n...<end_of_turn>\\n`` and ``model`` for the
assistant; there is no system role, so a leading system message opens the first turn,
followed by a blank line. Roles other than the assistant's (a tool result the API layer
renders as a user message, a later system message) are user turns.
"""

from __future__ import annotations

__all__ = ["GEMMA_CHAT_TEMPLATE", "default_chat_template"]

GEMMA_CHAT_TEMPLATE = """\
{{- bos_token -}}
{%- set ns = namespace(prefix="", start=0) -%}
{%- if messages and messages[0]["role"] == "system" -%}
  {%- set ns.prefix = messages[0]["content"] if messages[0]["content"] is string
      else messages[0]["content"] | selectattr("type", "equalto", "text") | map(attribute="text") | join("\\n") -%}
  {%- set ns.prefix = ns.prefix | trim + "\\n\\n" -%}
  {%- set ns.start = 1 -%}
{%- endif -%}
{%- for message in messages[ns.start:] -%}
  {{- "<start_of_turn>" + ("model" if message["role"] in ("assistant", "model") else "user") + "\\n" -}}
  {%- if loop.first -%}{{- ns.prefix -}}{%- endif -%}
  {%- if message["content"] is string -%}
    {{- message["content"] | trim -}}
  {%- elif message["content"] -%}
    {%- for part in message["content"] -%}
      {%- if part["type"] == "text" -%}{{- part["text"] | trim -}}{%- endif -%}
    {%- endfor -%}
  {%- endif -%}
  {{- "<end_of_turn>\\n" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<start_of_turn>model\\n" -}}{%- endif -%}
"""

_DEFAULTS = {"gemma3": GEMMA_CHAT_TEMPLATE}


def default_chat_template(architecture: str) -> str | None:
    """The known chat format of ``architecture`` (a GGUF ``general.architecture``), or ``None``."""
    return _DEFAULTS.get(architecture)
