"""python_tool: JSON Schema from signatures, argument validation, errors as results."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Annotated, Any, Literal

import anyio
import pydantic
import pytest

from loopstack.harness.tools.tool import PythonTool, Tool, ToolResult, python_tool, serialize_result


def run(coro: Awaitable[Any]) -> Any:
    async def bounded() -> Any:
        with anyio.fail_after(5):
            return await coro

    return anyio.run(bounded)


class Address(pydantic.BaseModel):
    street: str
    zip_code: str | None = None


def test_schema_required_optional_and_defaults() -> None:
    @python_tool
    def search(query: str, limit: int = 10, exact: bool | None = None) -> list[str]:
        """Search the index."""
        return []

    params = search.info.parameters
    assert params["type"] == "object"
    assert params["required"] == ["query"]
    assert params["properties"]["query"] == {"type": "string"}
    assert params["properties"]["limit"] == {"type": "integer", "default": 10}
    assert params["properties"]["exact"]["default"] is None
    assert params["additionalProperties"] is False
    assert search.info.description == "Search the index."
    assert search.info.name == "search"


def test_schema_nested_model_list_and_literal() -> None:
    @python_tool
    def ship(to: Address, tags: list[str], speed: Literal["slow", "fast"] = "slow") -> str:
        """Ship a parcel."""
        return "ok"

    params = ship.info.parameters
    assert params["properties"]["to"] == {"$ref": "#/$defs/Address"}
    assert params["$defs"]["Address"]["required"] == ["street"]
    assert params["properties"]["tags"] == {"type": "array", "items": {"type": "string"}}
    assert params["properties"]["speed"] == {"enum": ["slow", "fast"], "type": "string", "default": "slow"}
    assert sorted(params["required"]) == ["tags", "to"]


def test_schema_keeps_a_field_named_title_and_field_descriptions() -> None:
    @python_tool
    def note(title: Annotated[str, pydantic.Field(description="the note's heading")]) -> str:
        return title

    assert note.info.parameters["properties"] == {"title": {"type": "string", "description": "the note's heading"}}


def test_options_override_name_description_and_flags() -> None:
    @python_tool(name="add_numbers", description="Adds.", namespace="math", is_concurrency_safe=True)
    def add(a: int, b: int) -> int:
        return a + b

    assert (add.info.name, add.info.description, add.info.namespace) == ("add_numbers", "Adds.", "math")
    assert add.is_concurrency_safe
    assert isinstance(add, Tool)


def test_sync_function_result() -> None:
    @python_tool
    def add(a: int, b: int = 1) -> int:
        return a + b

    assert run(add.call({"a": 2, "b": "3"})) == ToolResult("5")


def test_async_function_result_serialized_as_json() -> None:
    @python_tool
    async def lookup(to: Address) -> dict[str, Any]:
        await anyio.lowlevel.checkpoint()
        return {"street": to.street, "is_model": isinstance(to, Address)}

    result = run(lookup.call({"to": {"street": "Main"}}))
    assert result == ToolResult('{"street":"Main","is_model":true}')


def test_str_result_returned_as_is() -> None:
    @python_tool
    def echo(text: str) -> str:
        return text

    assert run(echo.call({"text": '"quoted"'})).text == '"quoted"'


def test_validation_error_names_the_field() -> None:
    @python_tool
    def ship(to: Address, count: int) -> str:
        return "ok"

    result = run(ship.call({"to": {"zip_code": "1"}, "count": "many"}))
    assert result.is_error
    assert "'ship'" in result.text
    assert "- to.street: Field required" in result.text
    assert "- count: Input should be a valid integer" in result.text


def test_unknown_argument_is_an_error() -> None:
    @python_tool
    def ping() -> str:
        return "pong"

    result = run(ping.call({"extra": 1}))
    assert result.is_error and "extra" in result.text


@pytest.mark.parametrize("is_async", [False, True])
def test_exception_becomes_error_result(is_async: bool) -> None:
    def fail(path: str) -> str:
        raise FileNotFoundError(f"no such file: {path}")

    async def fail_async(path: str) -> str:
        return fail(path)

    tool = python_tool(fail_async if is_async else fail)
    assert run(tool.call({"path": "x.txt"})) == ToolResult("FileNotFoundError: no such file: x.txt", is_error=True)


def test_varargs_rejected() -> None:
    def spread(*items: str) -> str:
        return ""

    with pytest.raises(TypeError, match="items"):
        python_tool(spread)


def test_with_info_copies() -> None:
    tool = python_tool(serialize_result)
    deferred = tool.with_info(defer_loading=True, namespace="util")
    assert isinstance(deferred, PythonTool)
    assert deferred.info.defer_loading and not tool.info.defer_loading
    assert run(deferred.call({"value": [1, 2]})).text == "[1,2]"
