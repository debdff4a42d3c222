"""Anthropic Messages API request models (`POST /v1/messages`,
`/v1/messages/count_tokens`), ordered like Anthropic's reference. Imports
pydantic only. Unknown fields are accepted and ignored.

Content blocks: `text`, `tool_use`, `tool_result` (other block kinds, such as
images, are refused: the gateway serves text models).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from server.protocol import LenientRequest, finite, joined_text, type_tag


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[TextBlock] = ""
    is_error: bool | None = None

    def text(self) -> str:
        return joined_text(self.content)


Block = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")],
    Discriminator(
        type_tag(""),
        custom_error_type="content_block_type",
        custom_error_message="content blocks are `text`, `tool_use` or `tool_result`",
    ),
]


class Message(_Block):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Block):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Block):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_Block):
    user_id: str | None = None


class _Request(LenientRequest):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "\n".join(b.text for b in self.system) or None


class MessagesRequest(_Request):
    max_tokens: Annotated[int, Field(ge=1)]
    metadata: Metadata | None = None
    stop_sequences: Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    # --- gateway extensions ---
    priority: int = 0

    _finite_fields = field_validator("temperature", "top_p")(finite)


class CountTokensRequest(_Request):
    pass
