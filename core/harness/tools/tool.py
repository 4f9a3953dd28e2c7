"""Tools the agent loop can call, and ``python_tool`` to build one from a typed function.

A tool is anything with an ``info`` (:class:`loopstack.tools.ToolInfo`, what the model
sees), an ``is_concurrency_safe`` flag (may run alongside other tool calls of the same
turn) and an async ``call(arguments) -> ToolResult``. ``call`` never raises for bad
arguments or a failing tool: the model reads the error and retries.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import anyio.to_thread
import pydantic
import pydantic_core

from loopstack.tools import ToolInfo

__all__ = ["PythonTool", "Tool", "ToolResult", "python_tool", "serialize_result"]


@dataclass(frozen=True)
class ToolResult:
    """What a tool call returns to the model.

    Attributes:
        text: the content the model reads.
        is_error: the call failed (bad arguments, an exception, a server-side error).
        loaded_tools: function tool definitions (Responses shape: ``{"type": "function",
            "name", "description", "parameters"}``) this result makes callable from now on.
            Tool search returns the schemas it found here; the agent then appends a
            ``tool_search_output`` item (output text plus ``tools``) instead of a plain
            ``function_call_output``, so the schemas enter the context at its end and the
            cached prefix stays valid.
    """

    text: str
    is_error: bool = False
    loaded_tools: tuple[dict[str, Any], ...] = ()


@runtime_checkable
class Tool(Protocol):
    """A callable tool: its schema, whether it may run concurrently, and ``call``."""

    info: ToolInfo
    is_concurrency_safe: bool

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        """Run the tool; errors come back as ``ToolResult(is_error=True)``, never raised."""
        ...


def serialize_result(value: Any) -> str:
    """A tool's return value as text: ``str`` as-is, anything else as JSON (pydantic's encoder)."""
    if isinstance(value, str):
        return value
    return pydantic_core.to_json(value, fallback=str).decode()


def _strip_titles(node: Any) -> Any:
    # pydantic adds a "title" to every schema; it costs tokens and tells the model nothing.
    # Keys under "properties"/"$defs" are names, not keywords, so a field named "title" stays.
    if isinstance(node, list):
        return [_strip_titles(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in ("properties", "$defs") and isinstance(value, dict):
            out[key] = {name: _strip_titles(sub) for name, sub in value.items()}
        elif key == "title" and isinstance(value, str):
            continue
        else:
            out[key] = _strip_titles(value)
    return out


def _arguments_model(fn: Callable[..., Any], name: str) -> type[pydantic.BaseModel]:
    hints = typing.get_type_hints(fn, include_extras=True)
    fields: dict[str, Any] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(f"tool {name!r}: parameter {param.name!r} must be a plain or keyword-only parameter")
        annotation = hints.get(param.name, Any)
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (annotation, default)
    config = pydantic.ConfigDict(extra="forbid", arbitrary_types_allowed=False)
    return pydantic.create_model(f"{name}_arguments", __config__=config, **fields)


def _format_validation_error(tool_name: str, error: pydantic.ValidationError) -> str:
    lines = [f"invalid arguments for tool {tool_name!r}:"]
    for item in error.errors(include_url=False):
        field_path = ".".join(str(part) for part in item["loc"]) or "(arguments)"
        lines.append(f"- {field_path}: {item['msg']}")
    return "\n".join(lines)


class PythonTool:
    """A tool backed by a Python function (sync functions run in a worker thread).

    Build one with :func:`python_tool`. Attributes mirror :class:`Tool`; ``fn`` is the
    wrapped function and ``arguments_model`` the pydantic model that validates arguments.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        namespace: str = "",
        defer_loading: bool = False,
        is_concurrency_safe: bool = False,
    ) -> None:
        tool_name = name or fn.__name__
        self.fn = fn
        self.arguments_model = _arguments_model(fn, tool_name)
        schema = _strip_titles(self.arguments_model.model_json_schema())
        self.info = ToolInfo(
            name=tool_name,
            description=description if description is not None else (inspect.getdoc(fn) or ""),
            parameters=schema,
            namespace=namespace,
            defer_loading=defer_loading,
        )
        self.is_concurrency_safe = is_concurrency_safe
        self._is_async = inspect.iscoroutinefunction(fn)

    def __repr__(self) -> str:
        return f"PythonTool({self.info.name!r})"

    def with_info(self, **changes: Any) -> PythonTool:
        """A copy with ``info`` fields replaced (e.g. ``namespace=``, ``defer_loading=``)."""
        copy = object.__new__(PythonTool)
        copy.__dict__.update(self.__dict__)
        copy.info = replace(self.info, **changes)
        return copy

    async def call(self, arguments: dict[str, Any]) -> ToolResult:
        try:
            validated = self.arguments_model.model_validate(arguments)
        except pydantic.ValidationError as error:
            return ToolResult(_format_validation_error(self.info.name, error), is_error=True)
        # Field values, not model_dump(): a nested model argument stays a model instance.
        kwargs = {field: getattr(validated, field) for field in type(validated).model_fields}
        try:
            if self._is_async:
                value = await self.fn(**kwargs)
            else:
                value = await anyio.to_thread.run_sync(lambda: self.fn(**kwargs))
            return ToolResult(serialize_result(value))
        except Exception as error:  # the model reads the failure and may retry
            return ToolResult(f"{type(error).__name__}: {error}", is_error=True)


@typing.overload
def python_tool(fn: Callable[..., Any], /) -> PythonTool: ...


@typing.overload
def python_tool(
    *,
    name: str | None = None,
    description: str | None = None,
    namespace: str = "",
    defer_loading: bool = False,
    is_concurrency_safe: bool = False,
) -> Callable[[Callable[..., Any]], PythonTool]: ...


def python_tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    namespace: str = "",
    defer_loading: bool = False,
    is_concurrency_safe: bool = False,
) -> PythonTool | Callable[[Callable[..., Any]], PythonTool]:
    """Build a :class:`PythonTool` from a typed function; usable bare or with options.

    The JSON Schema comes from the signature through pydantic (``Annotated[x, Field(...)]``
    adds per-field descriptions), the description from the docstring.

    Args:
        fn: the function (sync or async); parameters need type hints (missing ones are ``Any``).
        name: tool name (default: the function name).
        description: overrides the docstring.
        namespace: where the tool comes from ("" for local tools).
        defer_loading: ask to be found through search rather than listed.
        is_concurrency_safe: may run alongside other calls of the same turn (read-only tools).

    Returns:
        The tool, or a decorator producing it when called with options only.

    Raises:
        TypeError: a parameter is ``*args``, ``**kwargs`` or positional-only.

    Example:
        >>> @python_tool(is_concurrency_safe=True)
        ... def add(a: int, b: int = 1) -> int:
        ...     "Add two numbers."
        ...     return a + b
        >>> add.info.parameters["required"]
        ['a']
    """

    def build(function: Callable[..., Any]) -> PythonTool:
        return PythonTool(
            function,
            name=name,
            description=description,
            namespace=namespace,
            defer_loading=defer_loading,
            is_concurrency_safe=is_concurrency_safe,
        )

    return build(fn) if fn is not None else build
