"""TypeScript declarations generated from tool JSON Schemas."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from loopstack.harness.tools.tool import python_tool
from loopstack.plugins.code_mode.declarations import declare_tools, schema_to_type
from loopstack.tools import ToolInfo


def test_required_optional_docs_and_enums_from_a_python_tool():
    @python_tool
    def get_weather(city: Annotated[str, Field(description="city name")], unit: Literal["C", "F"] = "C",
                    days: int = 1) -> dict:
        """Current weather in a city."""
        return {}

    assert declare_tools([get_weather.info]) == "\n".join([  # one line per line
        "declare const tools: {",
        "  /** Current weather in a city. */",
        "  get_weather(args: {",
        "    /** city name */",
        "    city: string;",
        "    /** (default: \"C\") */",
        '    unit?: "C" | "F";',
        "    /** (default: 1) */",
        "    days?: number;",
        "  }): Promise<any>;",
        "};",
    ])


def test_primitive_types():
    assert [schema_to_type({"type": t}) for t in ("string", "integer", "number", "boolean", "null")] == [
        "string", "number", "number", "boolean", "null"]
    assert schema_to_type({}) == "any" and schema_to_type({"type": "mystery"}) == "any"


def test_arrays_tuples_maps_unions_and_intersections():
    assert schema_to_type({"type": "array", "items": {"type": "string"}}) == "string[]"
    assert schema_to_type({"type": "array", "items": {"type": ["string", "null"]}}) == "(string | null)[]"
    assert schema_to_type({"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]}) == "[string, number]"
    assert schema_to_type({"type": "object", "additionalProperties": {"type": "integer"}}) == "{ [key: string]: number }"
    assert schema_to_type({"type": "object"}) == "{ [key: string]: any }"
    assert schema_to_type({"anyOf": [{"type": "string"}, {"type": "null"}]}) == "string | null"
    assert schema_to_type({"oneOf": [{"const": 1}, {"const": "a"}]}) == '1 | "a"'
    assert schema_to_type({"allOf": [{"type": "string"}, {"enum": ["x", "y"]}]}) == 'string & ("x" | "y")'


def test_nested_objects_keep_their_members_and_comments():
    schema = {
        "type": "object",
        "properties": {
            "filter": {
                "type": "object",
                "description": "what to keep",
                "properties": {"min_stars": {"type": "integer", "description": "at least this many"},
                               "labels": {"type": "array", "items": {"type": "string"}}},
                "required": ["min_stars"],
            },
        },
    }
    assert schema_to_type(schema) == "\n".join([  # one line per line
        "{",
        "  /** what to keep */",
        "  filter?: {",
        "    /** at least this many */",
        "    min_stars: number;",
        "    labels?: string[];",
        "  };",
        "}",
    ])


def test_refs_become_named_types_and_recursion_terminates():
    schema = {
        "type": "object",
        "properties": {"tree": {"$ref": "#/$defs/Node"}},
        "required": ["tree"],
        "$defs": {"Node": {"type": "object", "properties": {
            "value": {"type": "integer"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
        }, "required": ["value"]}},
    }
    text = declare_tools([ToolInfo("walk", "Sum a tree.", schema)])
    assert text.startswith("type Node = {\n  value: number;\n  children?: Node[];\n};\ndeclare const tools: {\n")
    assert "    tree: Node;" in text


def test_odd_names_are_quoted_and_comment_terminators_escaped():
    info = ToolInfo("github.search-issues", "Find issues */ evil", {
        "type": "object", "properties": {"per page": {"type": "integer"}}, "required": []})
    text = declare_tools([info])
    assert '"github.search-issues"(args?: {' in text and '"per page"?: number;' in text
    assert "/** Find issues *\\/ evil */" in text


def test_a_tool_without_parameters_takes_an_optional_empty_object():
    assert "  ping(args?: {}): Promise<any>;" in declare_tools([ToolInfo("ping", "", {"type": "object", "properties": {}})])
