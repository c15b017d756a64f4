"""Incremental detokenization with stop strings.

Each new token costs O(1) decoding work (tokenizers' DecodeStream keeps the
state of byte-level merges and half-finished UTF-8 characters), and stop
strings are searched only in the window the new text can complete.
"""

from __future__ import annotations

from collections.abc import Sequence

from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens fed to the stream first, so the first output token decodes in
# context (leading spaces, characters split across the prompt boundary).
_PROMPT_CONTEXT_TOKENS = 8


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        # Step through the context and drop its text: seeding the stream with
        # ids= re-emits the context when the prompt ends inside a character.
        for token_id in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]:
            self._stream.step(self._backend, token_id)
        self._stop = list(stop)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self.num_tokens = 0
        self.output_text = ""

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Decode new tokens; returns the stop string that ended the text, if any
        (the text is then truncated at it)."""
        added = 0
        for token_id in new_token_ids:
            chunk = self._stream.step(self._backend, token_id)
            self.num_tokens += 1
            if chunk:
                self.output_text += chunk
                added += len(chunk)
        if not added or not self._stop or self.num_tokens <= self._min_tokens:
            return None
        return self._check_stop(added)

    def _check_stop(self, num_new_chars: int) -> str | None:
        # A match must end inside the new text, so it starts no earlier than
        # this; older text was searched before.
        search_from = max(0, len(self.output_text) - num_new_chars - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self.output_text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.output_text = self.output_text[: index + len(stop) if self._include_stop else index]
        return stop

    def decode_token(self, token_id: int) -> str:
        """The text of one token on its own (for logprob entries)."""
        return self._backend.decode([token_id], skip_special_tokens=False)
