"""Responses API input -> chat-template messages -> prompt text.

Two steps, both deterministic and append-only (prefix caching depends on it):

1. :func:`items_to_messages` turns ``instructions`` and the input items (``message``,
   ``function_call``, ``function_call_output``, ``tool_search_output``) into Hugging Face
   style chat messages. A ``tool_search_output`` is the result of a tool search: the tools it
   loaded come with it, at the end of the conversation, so the cached prefix stays valid;
   :func:`loaded_tools` lists them (calls to them are accepted like calls to ``tools``).
2. :func:`render_prompt` renders them with the model's chat template. A template that reads
   ``tools`` gets the tools natively; any other one gets a Hermes-style block in the system
   turn, tool calls written as ``<tool_call>`` JSON blocks and tool results as
   ``<tool_response>`` user turns (one per result, so appending a result never rewrites one).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.meta

from loopstack.items import MESSAGE_ROLES, ConversationError, content_text, items_to_chat_messages

if TYPE_CHECKING:
    from loopstack.engine.text.tokenizer import Tokenizer

__all__ = [
    "ConversationError",
    "HOSTED_TOOL_TYPES",
    "FunctionTool",
    "InvalidToolError",
    "chat_messages",
    "format_tool_call",
    "hermes_tools_block",
    "items_to_messages",
    "loaded_tools",
    "normalize_tools",
    "qualified_name",
    "render_prompt",
    "split_hosted_tools",
    "template_supports_tools",
]

_HERMES_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_HERMES_INSTRUCTION = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


class InvalidToolError(ValueError):
    """A tool definition is not a usable function tool; the message names ``tools[i]``."""


@dataclass(frozen=True)
class FunctionTool:
    """One function tool, whatever API shape it came in.

    ``name`` is what the model sees and writes: a function inside a ``namespace`` tool is
    ``namespace.function`` (the dot cannot occur in an API function name, so it never collides
    with a plain one); ``namespace`` and :attr:`api_name` are how the API names it in a
    ``function_call`` item."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    namespace: str | None = None
    defer_loading: bool = False

    @property
    def api_name(self) -> str:
        """The function's own name: ``name`` without its namespace."""
        return self.name[len(self.namespace) + 1:] if self.namespace else self.name

    def to_chat_dict(self) -> dict[str, Any]:
        """The chat-completions shape chat templates expect: ``{"type": "function", "function": {...}}``."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


# Responses API tools the server would have to run itself: ``omit`` (the default) leaves them out
# of the prompt with a warning, ``reject`` answers 400 naming the tool (ApiConfig.hosted_tools).
HOSTED_TOOL_TYPES = (
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "computer_use_preview", "computer", "image_generation", "mcp", "local_shell", "shell",
    "apply_patch",
)
TOOL_TYPES = ("function", "namespace")


def qualified_name(namespace: str | None, name: str) -> str:
    """The name the model writes for function ``name`` of ``namespace`` (see :class:`FunctionTool`)."""
    return f"{namespace}.{name}" if namespace else name


def split_hosted_tools(tools: Sequence[Any] | None) -> tuple[list[Any], list[str]]:
    """``tools`` without the hosted ones, and the hosted ones' types (in order, for the message)."""
    kept, hosted = [], []
    for tool in tools or ():
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind in HOSTED_TOOL_TYPES:
            hosted.append(str(kind))
        else:
            kept.append(tool)
    return kept, hosted


def normalize_tools(tools: Sequence[Mapping[str, Any] | FunctionTool] | None) -> list[FunctionTool]:
    """Normalize Responses (flat), chat-completions (nested ``function``) and ``namespace`` tool
    definitions: a namespace's functions come out one by one, named ``namespace.function``.

    Raises:
        InvalidToolError: a tool is not a function or a namespace of functions (a hosted tool
            here is an error too: :func:`split_hosted_tools` takes those out first), lacks a
            name, or repeats a name.
    """
    result: list[FunctionTool] = []
    for index, tool in enumerate(tools or ()):
        if isinstance(tool, FunctionTool):
            result.append(tool)
            continue
        kind = tool.get("type") if isinstance(tool, Mapping) else type(tool).__name__
        if kind == "namespace":
            result.extend(_namespace_tools(f"tools[{index}]", tool))
        elif kind == "function":
            result.append(_function_tool(f"tools[{index}]", tool, None))
        else:
            hosted = " (a hosted tool: the server's api.hosted_tools setting omits or rejects these)" \
                if kind in HOSTED_TOOL_TYPES else ""
            raise InvalidToolError(f"tools[{index}]: type {kind!r} is not supported; allowed: "
                                   f"{', '.join(map(repr, TOOL_TYPES))}{hosted}")
    duplicates = sorted(name for name, count in Counter(t.name for t in result).items() if count > 1)
    if duplicates:
        raise InvalidToolError(f"tools: duplicate function names {duplicates}")
    return result


def _namespace_tools(where: str, tool: Mapping[str, Any]) -> list[FunctionTool]:
    namespace, members = tool.get("name"), tool.get("tools")
    if not isinstance(namespace, str) or not namespace or "." in namespace:
        raise InvalidToolError(f"{where}: a namespace tool needs a non-empty string 'name' without '.'")
    if not isinstance(members, Sequence) or isinstance(members, str):
        raise InvalidToolError(f"{where} ({namespace}): a namespace tool needs a 'tools' list")
    result = []
    for position, member in enumerate(members):
        inner = f"{where}.tools[{position}]"
        kind = member.get("type") if isinstance(member, Mapping) else type(member).__name__
        if kind != "function":
            raise InvalidToolError(f"{inner}: type {kind!r} is not supported in a namespace; allowed: 'function'")
        function = _function_tool(inner, member, namespace)
        if tool.get("defer_loading") is True:
            function = dataclasses.replace(function, defer_loading=True)
        result.append(function)
    return result


def _function_tool(where: str, tool: Mapping[str, Any], namespace: str | None) -> FunctionTool:
    spec = tool["function"] if isinstance(tool.get("function"), Mapping) else tool
    name, parameters = spec.get("name"), spec.get("parameters")
    if not isinstance(name, str) or not name:
        raise InvalidToolError(f"{where}: a function tool needs a non-empty string 'name'")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise InvalidToolError(f"{where} ({name}): 'parameters' must be a JSON Schema object")
    strict = spec.get("strict")
    return FunctionTool(
        name=qualified_name(namespace, name),
        description=spec.get("description"),
        parameters=None if parameters is None else dict(parameters),
        strict=strict if isinstance(strict, bool) else None,
        namespace=namespace,
        defer_loading=spec.get("defer_loading") is True,
    )


# -- items -> messages -------------------------------------------------------------------

def items_to_messages(instructions: str | None, items: str | Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Turn Responses API ``instructions`` + ``input`` into chat-template messages.

    ``instructions`` becomes the first system message; ``developer`` maps to ``system``. A
    ``function_call`` joins the assistant turn right before it (consecutive calls make one
    turn, as the model produced them); ``function_call_output`` becomes a ``tool`` message.
    A plain string input is one user message.

    Raises:
        ConversationError: an unknown item type, role or content part, or a missing field;
            the message names ``input[i]`` and what is allowed.

    Example:
        >>> items_to_messages("Be brief.", [{"role": "user", "content": "hi"}])
        [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'hi'}]
    """
    # the one items -> chat messages converter (strict: the message names input[i]), then the
    # chat -> template step the Chat Completions route takes too (arguments parsed, tool names)
    return chat_messages(items_to_chat_messages(instructions, items, strict=True, loaded_tools_text=_loaded_tools_block))


def loaded_tools(items: str | Sequence[Mapping[str, Any]]) -> list[FunctionTool]:
    """The tools that ``tool_search_output`` items in ``items`` loaded, first load of a name wins.

    Raises:
        InvalidToolError: a loaded tool is not a usable function tool.
    """
    if isinstance(items, str):
        return []
    found: dict[str, FunctionTool] = {}
    for item in items:
        if isinstance(item, Mapping) and item.get("type") == "tool_search_output":
            for tool in normalize_tools(item.get("tools") or ()):
                found.setdefault(tool.name, tool)
    return list(found.values())


def _loaded_tools_block(where: str, tools: Sequence[Any]) -> str:
    # after a search's text, the loaded schemas as the system block writes tools (one JSON
    # line each), so the model reads them the way it reads the up-front tools
    try:
        function_tools = normalize_tools(tools)
    except InvalidToolError as exc:
        raise ConversationError(f"{where}.{exc}") from None
    if not function_tools:
        return ""
    lines = "\n".join(json.dumps(t.to_chat_dict(), ensure_ascii=False) for t in function_tools)
    return f"\n<tools>\n{lines}\n</tools>"


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Turn Chat Completions ``messages`` into the chat-template messages :func:`render_prompt` takes.

    Raises:
        ConversationError: an unknown role or content part, or a malformed tool call; the
            message names ``messages[i]``.
    """
    result: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        role = message.get("role") if isinstance(message, Mapping) else None
        if role == "tool":
            result.append(_tool_message(where, result, message.get("tool_call_id"), message.get("content")))
            continue
        if role not in MESSAGE_ROLES:
            raise ConversationError(f"{where}: unknown role {role!r}; allowed: {', '.join(MESSAGE_ROLES)}, tool")
        converted: dict[str, Any] = {"role": MESSAGE_ROLES[role], "content": _content_text(where, message.get("content") or "")}
        calls = message.get("tool_calls") if role == "assistant" else None
        for call in calls or ():
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping):
                raise ConversationError(f"{where}: each tool call needs a 'function' object")
            converted.setdefault("tool_calls", []).append(
                _tool_call(where, call.get("id"), function.get("name"), function.get("arguments", "{}"))
            )
        result.append(converted)
    return result


def _content_text(where: str, content: Any) -> str:
    return content_text(content, strict=True, where=where)


def _tool_call(where: str, call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
        raise ConversationError(f"{where}: a function call needs non-empty string 'call_id' (or 'id') and 'name'")
    if not isinstance(arguments, str):
        raise ConversationError(f"{where}: function call 'arguments' must be a JSON string")
    try:
        parsed: Any = json.loads(arguments)
    except ValueError:
        parsed = arguments  # kept verbatim: the model sees what it wrote
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}


def _tool_message(where: str, earlier: Sequence[Mapping[str, Any]], call_id: Any, output: Any) -> dict[str, Any]:
    if not isinstance(call_id, str) or not call_id:
        raise ConversationError(f"{where}: a tool result needs a non-empty string 'call_id' (or 'tool_call_id')")
    if output is None:
        raise ConversationError(f"{where}: a tool result needs 'output' (or 'content')")
    message = {"role": "tool", "tool_call_id": call_id, "content": _content_text(where, output)}
    names = [c["function"]["name"] for m in earlier for c in m.get("tool_calls", ()) if c["id"] == call_id]
    if names:
        message["name"] = names[-1]
    return message


# -- messages -> prompt ------------------------------------------------------------------

@functools.lru_cache(maxsize=32)
def template_supports_tools(chat_template: str | None) -> bool:
    """True if the jinja template reads a ``tools`` variable (so it renders tools natively).

    The template is parsed, not searched as text: ``tool_calls`` or a comment mentioning
    tools does not count. An unparsable template counts as not supporting tools.
    """
    if not chat_template:
        return False
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(chat_template))
    except jinja2.TemplateSyntaxError:
        return False


def format_tool_call(name: str, arguments: Any) -> str:
    """One Hermes block, exactly as the tool-call grammar makes the model write it::

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>
    """
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n</tool_call>'


def hermes_tools_block(tools: Sequence[FunctionTool]) -> str:
    """The system-prompt section listing ``tools`` (one JSON line each) and the call format."""
    lines = "\n".join(json.dumps(t.to_chat_dict(), ensure_ascii=False) for t in tools)
    return _HERMES_PREAMBLE + lines + _HERMES_INSTRUCTION


def render_prompt(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any] | FunctionTool] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> str:
    """Render ``messages`` (from :func:`items_to_messages`) and ``tools`` into prompt text.

    Native when the template reads ``tools``; otherwise Hermes-style (see the module doc).
    Append-only: without the generation prompt, the rendering of ``messages[:n]`` is a prefix
    of the rendering of ``messages[:n + 1]``.

    Raises:
        InvalidToolError: a bad tool definition.
        ChatTemplateError: the model has no template, or it rejected the messages.
    """
    function_tools = normalize_tools(tools)
    if template_supports_tools(tokenizer.chat_template):
        chat_tools = [t.to_chat_dict() for t in function_tools] or None
        return tokenizer.apply_chat_template(messages, tools=chat_tools, add_generation_prompt=add_generation_prompt)
    hermes = [_hermes_message(m) for m in messages]
    if function_tools:
        block = hermes_tools_block(function_tools)
        if hermes and hermes[0]["role"] == "system":
            hermes[0] = {"role": "system", "content": f"{hermes[0]['content']}\n\n{block}"}
        else:
            hermes.insert(0, {"role": "system", "content": block})
    return tokenizer.apply_chat_template(hermes, add_generation_prompt=add_generation_prompt)


def _hermes_message(message: Mapping[str, Any]) -> dict[str, str]:
    content = message.get("content") or ""
    if message.get("role") == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls") or ()
    if calls:
        # no separator between blocks: the grammar writes them back to back (see tool_calls.py)
        blocks = "".join(format_tool_call(c["function"]["name"], c["function"]["arguments"]) for c in calls)
        content = f"{content}\n{blocks}" if content else blocks
    return {"role": str(message.get("role")), "content": content}
