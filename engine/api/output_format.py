"""What a reply must be, from whichever request field says it: OpenAI's `response_format`
(`json_object`, `json_schema`), vLLM's `structured_outputs` and its older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`, or the tool call that `tool_choice`
requires (engine/api/tool_choice.py). One request, one constraint: a second field that asks for
another is refused rather than one of them quietly winning. A malformed or broken one is a 400
whose `param` is the field the caller used."""
from __future__ import annotations

from dataclasses import dataclass

from engine.api.errors import bad_request
from engine.api.protocol import SamplingFields
from engine.core.sampling_params import StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    field: str  # the request field that asked for it
    defined_in: str = ""  # where its definition is, when elsewhere (a tool's parameters are in `tools`)

    @property
    def error_field(self) -> str:
        """What a 400 for a definition that does not compile names."""
        return self.defined_in or self.field


def constraint_of(body: SamplingFields, tool_constraint: Constraint | None = None) -> Constraint | None:
    """The request's one constraint (`tool_constraint`: the one its tool_choice makes), or None;
    APIError 400 when two fields ask for one, or when the one asked for is malformed."""
    asked = []
    if body.response_format is not None and body.response_format.type != "text":
        asked.append("response_format")
    if body.structured_outputs is not None:
        asked.append("structured_outputs")
    asked += [name for name in GUIDED if getattr(body, name) is not None]
    if tool_constraint is not None:
        asked.append(tool_constraint.field)
    if len(asked) > 1:
        raise bad_request(f"{asked[0]} and {asked[1]} both constrain the reply; a request takes one", asked[1])
    if not asked:
        return None
    if tool_constraint is not None:
        return tool_constraint
    field = asked[0]
    try:
        return Constraint(_params(body, field), field)
    except ValueError as error:
        message = str(error)
        raise bad_request(message if message.startswith(field) else f"{field}: {message}", field) from None


def _params(body: SamplingFields, field: str) -> StructuredOutputsParams:
    if field == "response_format":
        response_format = body.response_format
        if response_format.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if response_format.json_schema is None:
            raise ValueError('type "json_schema" needs a `json_schema` object: {"name": ..., "schema": {...}}')
        return StructuredOutputsParams(json=response_format.json_schema.schema_)
    if field == "structured_outputs":
        return body.structured_outputs.params()
    return StructuredOutputsParams(**{GUIDED[field]: getattr(body, field)})
