"""What an agent is told about a tool: :class:`ToolSpec`, from the tool's code.

The input schema is the tool body's signature (its type hints, through
pydantic), the output schema its return annotation, the description its
docstring, the annotations its declared effect. Nothing of it comes from
configuration: like the effect, a tool's interface is a property of its code.
Every agent integration (the MCP server, each SDK adapter) describes a tool
with one ``ToolSpec`` and validates an agent's arguments with it, so that
they all show the model the same schema and refuse the same arguments.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .extras import ANY_AGENT_EXTRA, missing_extra

try:
    import pydantic
    from pydantic import ConfigDict, TypeAdapter, ValidationError
except ModuleNotFoundError as exc:  # no agent extra installed
    raise missing_extra(exc, __name__, ANY_AGENT_EXTRA) from exc
from celery import Task

from ..effect import ToolEffect
from ..errors import InvalidToolArguments, ToolSchemaError
from ..states import CallStatus

if TYPE_CHECKING:
    from ..task import ToolTask

#: The largest arguments an agent may send to one call, as compact JSON
#: (``tooleffect_agent_max_argument_bytes`` changes it): a tool's arguments
#: travel in a broker message and in the journal's digest, and a model that
#: sends megabytes is wrong, not busy.
MAX_ARGUMENT_BYTES = 256 * 1024

#: A name every agent SDK accepts for a function (OpenAI's function calling:
#: letters, digits, ``_`` and ``-``, at most 64); MCP also allows ``.``.
_FUNCTION_NAME = re.compile(r"[^A-Za-z0-9_-]")


@dataclass(frozen=True)
class ToolSpec:
    """One tool as an agent sees it. Built by :meth:`of`; never changed."""

    #: The task's name (the MCP tool name).
    name: str
    #: The docstring's first sentence, or the name (MCP ``title``).
    title: str
    #: The docstring, whole.
    description: str
    effect: ToolEffect
    #: JSON Schema of the arguments: an object, no other properties.
    input_schema: dict[str, Any]
    #: JSON Schema of the tool's result (its return annotation); None without one.
    result_schema: dict[str, Any] | None
    #: MCP tool annotations: the effect's hints and the title.
    annotations: dict[str, Any]
    #: Whether some of its calls wait for a person (``requires_approval``).
    requires_approval: bool
    max_argument_bytes: int = MAX_ARGUMENT_BYTES
    _arguments: type[pydantic.BaseModel] | None = field(default=None, repr=False,
                                                        compare=False)

    @property
    def arguments_model(self) -> type[pydantic.BaseModel]:
        """The pydantic model of the arguments (what :meth:`validate` checks)."""
        assert self._arguments is not None, "ToolSpec.of() builds the validator"
        return self._arguments

    @property
    def function_name(self) -> str:
        """The name as a function-calling API accepts it (``agent.send_invoice``
        becomes ``agent_send_invoice``): what the SDK adapters name the tool."""
        return _FUNCTION_NAME.sub("_", self.name)[:64]

    @classmethod
    def of(cls, task: ToolTask, *, max_argument_bytes: int = MAX_ARGUMENT_BYTES) -> ToolSpec:
        """Describe ``task`` (a registered ToolTask). Raises
        :class:`ToolSchemaError`, naming the tool and the parameter, for a
        signature an agent cannot be told: a parameter without a type
        annotation, ``*args``/``**kwargs``, a positional-only parameter, or a
        type pydantic cannot describe as JSON Schema."""
        # ``@app.task`` before the app is finalized answers a proxy (celery.local).
        task = getattr(task, "_get_current_object", lambda: task)()
        name = str(task.name)
        run = task.run
        try:
            signature = inspect.signature(run)
            hints = typing.get_type_hints(run, include_extras=True)
        except (TypeError, ValueError, NameError) as exc:
            raise ToolSchemaError(f"{name}: its signature cannot be read: {exc}") from exc
        fields: dict[str, Any] = {}
        for parameter in signature.parameters.values():
            where = f"{name}: parameter {parameter.name!r}"
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                raise ToolSchemaError(f"{where}: *args and **kwargs cannot be described "
                                      "to an agent; name each argument")
            if parameter.kind is parameter.POSITIONAL_ONLY:
                raise ToolSchemaError(f"{where} is positional-only; an agent passes "
                                      "arguments by name")
            if parameter.name not in hints:
                raise ToolSchemaError(f"{where} has no type annotation: add a type "
                                      f"hint ({parameter.name}: str, say); an agent "
                                      "is told each argument's type")
            default = ... if parameter.default is parameter.empty else parameter.default
            fields[parameter.name] = (hints[parameter.name], default)
        model_name = _FUNCTION_NAME.sub("_", name) + "_arguments"
        try:
            arguments = pydantic.create_model(
                model_name, __config__=ConfigDict(extra="forbid"), **fields,
            )
            input_schema = arguments.model_json_schema()
        except (pydantic.PydanticSchemaGenerationError,
                pydantic.errors.PydanticInvalidForJsonSchema, TypeError) as exc:
            raise ToolSchemaError(f"{name}: its arguments cannot be described: {exc}") from exc
        input_schema.pop("title", None)
        result_schema = _result_schema(name, hints.get("return"))
        effect = task.tool_effect
        description = _description(task)
        title = _first_sentence(description) or name
        annotations: dict[str, Any] = {"title": title, **task.mcp_annotations()}
        return cls(
            name=name, title=title, description=description or name, effect=effect,
            input_schema=input_schema, result_schema=result_schema,
            annotations=annotations, requires_approval=bool(type(task).requires_approval),
            max_argument_bytes=max_argument_bytes, _arguments=arguments,
        )

    def validate(self, arguments: Any) -> dict[str, Any]:
        """The keyword arguments to publish for an agent's ``arguments`` (a
        mapping, or its JSON text): checked against the input schema, values
        in their JSON form, arguments the agent left out left out (the body's
        defaults apply). Raises :class:`InvalidToolArguments`, naming each
        field that does not fit, or the size limit."""
        if isinstance(arguments, (str, bytes)):
            size = len(arguments)
            if size > self.max_argument_bytes:
                raise self._too_large(size)
            try:
                arguments = json.loads(arguments or "{}")
            except ValueError as exc:
                raise InvalidToolArguments(f"{self.name}: the arguments are not JSON: {exc}",
                                           tool=self.name) from exc
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise InvalidToolArguments(
                f"{self.name}: the arguments must be an object of named arguments, not "
                f"{type(arguments).__name__}", tool=self.name)
        size = len(json.dumps(arguments, separators=(",", ":"), default=str).encode())
        if size > self.max_argument_bytes:
            raise self._too_large(size)
        try:
            model = self.arguments_model.model_validate(arguments)
        except ValidationError as exc:
            errors = [
                {"field": ".".join(str(part) for part in error["loc"]) or "(arguments)",
                 "message": error["msg"], "type": error["type"]}
                for error in exc.errors(include_url=False, include_input=False)
            ]
            named = "; ".join(f"{error['field']}: {error['message']}" for error in errors)
            raise InvalidToolArguments(f"{self.name}: invalid arguments: {named}",
                                       tool=self.name, errors=errors) from None
        return dict(model.model_dump(mode="json", exclude_unset=True))

    @property
    def output_schema(self) -> dict[str, Any] | None:
        """JSON Schema of what a call answers (MCP ``outputSchema``): the
        :class:`~celery_tooleffect.agents.calls.CallReport` envelope, an object
        whose ``status`` and ``task_id`` every answer has and whose ``result``
        is the tool's result (once it succeeded). None without a return
        annotation. An envelope, not the bare result, because a call can also
        answer that it awaits approval or still runs, and MCP's outputSchema
        must describe an object."""
        if self.result_schema is None:
            return None
        result = dict(self.result_schema)
        defs = result.pop("$defs", None)
        envelope: dict[str, Any] = {
            "type": "object",
            "properties": {
                "status": {"type": "string", "enum": list(CallStatus.values())},
                "task_id": {"type": "string"},
                "result": result,
                # A result longer than the model is given: left out, its size
                # named; the message holds its cut text and a note.
                "result_truncated": {"type": "boolean"},
                "result_bytes": {"type": "integer"},
                "message": {"type": "string"},
            },
            "required": ["status", "task_id"],
        }
        if defs is not None:  # references stay "#/$defs/...": the definitions move up
            envelope["$defs"] = defs
        return envelope

    def _too_large(self, size: int) -> InvalidToolArguments:
        return InvalidToolArguments(
            f"{self.name}: the arguments are {size} bytes of JSON; a call takes at most "
            f"{self.max_argument_bytes} (tooleffect_agent_max_argument_bytes)", tool=self.name)


def _result_schema(name: str, returns: Any) -> dict[str, Any] | None:
    """The JSON Schema of a return annotation (None for none, ``None`` or ``Any``)."""
    if returns is None or returns is type(None) or returns is Any:
        return None
    try:
        return TypeAdapter(returns).json_schema(mode="serialization")
    except (pydantic.PydanticSchemaGenerationError,
            pydantic.errors.PydanticInvalidForJsonSchema, TypeError) as exc:
        raise ToolSchemaError(f"{name}: its return type cannot be described: {exc}") from exc


def _description(task: ToolTask) -> str:
    """The tool's docstring: the class's (Celery gives a function task's class
    the function's), else its ``run``'s own, never Celery's ``Task.run``'s."""
    own = type(task).__doc__  # a class's __doc__ is its own: never inherited
    if own:
        return inspect.cleandoc(own)
    run_doc = inspect.getdoc(task.run)
    return "" if run_doc is None or run_doc == inspect.getdoc(Task.run) else run_doc


def _first_sentence(text: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line (it may wrap)."""
    paragraph = " ".join(text.strip().split("\n\n")[0].split())
    end = paragraph.find(". ")
    return paragraph if end < 0 else paragraph[: end + 1]
