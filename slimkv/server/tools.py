"""Tool calling's request fields (OpenAI's ``tools``, ``tool_choice``,
``parallel_tool_calls`` and the assistant turns' ``tool_calls``) and what a request makes
of them: a :class:`ToolPlan`, the grammar the reply must follow and what the template gets.

A request whose tools cannot be served as asked is a 400 naming the field: a
``tool_choice`` without ``tools``, a named function that is not among them, two tools of
one name, a parameter schema llguidance cannot compile, and ``response_format`` together
with a tool grammar (one grammar per request).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, Field

from slimkv.options.structured import canonical_schema, schema_error
from slimkv.options.tool_calls import ToolSpec, tool_grammar
from slimkv.options.tool_formats import ToolCallFormat
from slimkv.server.errors import APIError

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
NO_PARAMETERS = {"type": "object", "properties": {}}


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        default=None, description="JSON schema of the arguments (none: no arguments)")
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class AssistantToolCall(BaseModel):
    """A call in an assistant turn of the history (the reply's own ``tool_calls``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(BaseModel):
    """The chat request's tool fields (mixed into its model)."""

    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = Field(
        default=None, description="none, auto (the default with tools), required, or "
        '{"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: bool = Field(
        default=True, description="false: at most one call per reply")


class ToolPlan(NamedTuple):
    """What a request with tools becomes: its grammar (None: the reply is free text) and
    the tool definitions its prompt shows."""

    grammar: str | None
    template_tools: list[dict] | None


NO_TOOLS = ToolPlan(None, None)


def tool_plan(body: ToolFields, fmt: ToolCallFormat, has_response_format: bool) -> ToolPlan:
    """The plan for ``body``'s tool fields, or an ``APIError`` (400) naming the bad field."""
    tools = body.tools or []
    choice = body.tool_choice
    if choice is not None and not tools:
        raise _bad("tool_choice", "tool_choice is only allowed when tools are given")
    if not tools:
        return NO_TOOLS
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise _bad("tools", "two tools have the same function name")
    specs = [ToolSpec(t.function.name, _parameters(i, t)) for i, t in enumerate(tools)]
    shown = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        return NO_TOOLS  # no call, so the prompt does not offer any
    if isinstance(choice, NamedToolChoice):
        specs = [s for s in specs if s.name == choice.function.name]
        if not specs:
            raise _bad("tool_choice", f"tool_choice names the function "
                       f"{choice.function.name!r}, which is not among the tools")
    if has_response_format:
        raise _bad("response_format", "response_format cannot be combined with tools "
                   "(unless tool_choice is none): a reply follows one grammar")
    named = isinstance(choice, NamedToolChoice)  # one call of that function, as vLLM does
    parallel = body.parallel_tool_calls and not named
    return ToolPlan(tool_grammar(fmt, specs, named or choice == "required", parallel), shown)


def _parameters(index: int, tool: Tool) -> str:
    parameters = tool.function.parameters or NO_PARAMETERS
    schema = canonical_schema(parameters)
    error = schema_error(schema)
    if parameters.get("type", "object") != "object":  # arguments are a JSON object
        error = error or f"the arguments' schema must be of type object, not {parameters['type']!r}"
    if error:
        raise _bad(f"tools[{index}].function.parameters", f"invalid JSON schema: {error}")
    return schema


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", "invalid_value", param)
