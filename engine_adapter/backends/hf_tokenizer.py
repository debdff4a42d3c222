"""The tokenizer vLLM loaded, seen through the gateway's Tokenizer protocol
(engine_adapter/types.py). Imports nothing of vLLM or transformers itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class HfTokenizer:
    """Adapts the tokenizer vLLM loaded to the gateway's Tokenizer protocol."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    @property
    def eos_token_id(self) -> int | None:
        eos = getattr(self._tok, "eos_token_id", None)
        return int(eos) if eos is not None else None

    @property
    def chat_template(self) -> str | None:
        t = getattr(self._tok, "chat_template", None)
        return t if isinstance(t, str) else None

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return [str(t) for t in self._tok.convert_ids_to_tokens(list(token_ids))]

    def warm_up(self) -> None:
        """Render the chat template and encode once, at engine start: the
        first render compiles the template (transformers caches it), which
        took 0.05-0.2 s of the first chat request's time (tokenizer of the
        embedded SmolLM2 on a 2-core CPU, 1,000x a later render)."""
        if self.chat_template is not None:
            text = self.apply_chat_template([{"role": "user", "content": "warm-up"}])
        else:
            text = "warm-up"
        self.encode(text)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> str:
        kwargs: dict[str, Any] = {}
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        out = self._tok.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **kwargs,
        )
        return str(out)
