"""OpenAI Responses API request models (`POST /v1/responses`), ordered like
the OpenAI reference; the gateway's extras fenced off at the end. Imports
pydantic only. Unknown fields are accepted and ignored.

Input items: messages (a string or `input_text` / `output_text` parts),
`function_call` and `function_call_output` items. Tools: functions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from server.protocol import LenientRequest, finite, joined_text, type_tag


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Item):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None

    def text(self) -> str:
        return joined_text(self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[ContentPart]
    id: str | None = None

    def text(self) -> str:
        return joined_text(self.output)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(
        type_tag("message"),
        custom_error_type="input_item_type",
        custom_error_message="input items are messages, function_call or function_call_output items",
    ),
]


class FunctionTool(_Item):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(_Item):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("text.format json_schema needs a schema")
        return self


class TextConfig(_Item):
    format: TextFormat | None = None


class ResponsesRequest(LenientRequest):
    model: str
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = True
    store: bool = True
    previous_response_id: str | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None
    user: str | None = None
    stream: bool = False
    # --- gateway extensions (as chat's) ---
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: int | None = None
    priority: int = 0

    _finite_fields = field_validator("temperature", "top_p")(finite)


class InputItemsQuery(BaseModel):
    limit: Annotated[int, Field(ge=1, le=100)] = 20
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None
