"""The served model as the gateway sees it: tokenizer, chat template, limits.

Engine pods speak token ids (docs/architecture.md, invariant 3): prompts are tokenized
here exactly as the offline `LLM` does (`tokenizer.encode`), so the same
text gives the same ids and the same greedy output either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.config import GatewayConfigError, ModelConfig
from tessera.context_length import read_config, resolve_max_model_len
from tessera.text import encode_prompt, load_eos_token_ids, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class PromptError(ValueError):
    """A prompt the model cannot take (message is client-facing)."""

    def __init__(self, message: str, code: str = "invalid_prompt", param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass
class ServedModel:
    name: str
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    block_size: int
    eos_token_ids: frozenset[int]
    # len(tokenizer) walks the added tokens each call: computed once.
    vocab_size: int = 0

    def __post_init__(self) -> None:
        self.vocab_size = self.vocab_size or len(self.tokenizer)

    @classmethod
    def load(cls, config: ModelConfig) -> ServedModel:
        tokenizer = load_tokenizer(config.path)
        # The engine pods' own limit (the same function derives it), or less.
        try:
            max_len = resolve_max_model_len(config.max_model_len, read_config(config.path))
        except ValueError as e:
            raise GatewayConfigError(f"model.{e}" if str(e).startswith("max_model_len") else str(e)) from None
        eos = frozenset(load_eos_token_ids(config.path, tokenizer))
        return cls(config.name, tokenizer, max_len, config.block_size, eos)

    def encode(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """`tools`: the functions the model may call, in OpenAI's shape (the template's `tools`)."""
        if not self.tokenizer.chat_template:
            raise PromptError(f"model {self.name!r} has no chat template; use /v1/completions", "no_chat_template")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as e:  # jinja raises TemplateError and friends for messages it refuses
            raise PromptError(f"messages: the chat template rejected them: {e}", "invalid_messages",
                              "messages") from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> list[int]:
        # The template writes the special tokens (BOS) itself.
        text = self.render_chat(messages, add_generation_prompt, tools)
        return encode_prompt(self.tokenizer, text, add_special_tokens=False)

    def check_token_ids(self, ids: list[int]) -> None:
        if not ids:
            raise PromptError("prompt: empty (give at least one token)", "empty_prompt", "prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                              "invalid_token_id", "prompt")

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The max_tokens to ask for; PromptError when the request cannot fit."""
        if num_prompt_tokens >= self.max_model_len:
            raise PromptError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                f"{num_prompt_tokens} tokens, which leaves no room for output. Please reduce the length of the prompt.",
                "context_length_exceeded", "prompt",
            )
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is not None and max_tokens > room:
            raise PromptError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for "
                f"the completion). Please reduce the length of the prompt or max_tokens.",
                "context_length_exceeded", "max_tokens",
            )
        return room if max_tokens is None else max_tokens
