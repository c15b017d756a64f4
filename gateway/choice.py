"""One choice of a request: engine responses -> text deltas, stop strings,
logprobs, finish reason (the gateway half of docs/architecture.md, invariant 3)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.request import ChoiceUpdate, SamplingOptions, TokenLogprob
from tessera.text import IncrementalDetokenizer
from tessera.v1 import engine_pb2 as epb

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class ChoiceState:
    def __init__(self, index: int, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 options: SamplingOptions) -> None:
        self.index = index
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, options.stop, options.include_stop_str_in_output,
            skip_special_tokens=True, min_tokens=options.min_tokens,
        )
        # While streaming, the last (longest stop - 1) characters are held
        # back: a stop string may start in them, and sent text cannot be
        # taken back.
        self.holdback = max((len(s) for s in options.stop), default=1) - 1
        self.num_sent_chars = 0
        self.want_logprobs = options.logprobs is not None
        # Where each output token's text starts in the choice's text (completions' logprobs
        # text_offset): from the same incremental decoding that builds the text, so a token that
        # decodes to nothing yet (a byte of an unfinished UTF-8 character) starts where the next does.
        self.text_offsets: list[int] = []
        self.num_tokens = 0
        self.num_cached_tokens: int | None = None
        self.finished = False

    def on_response(self, resp: epb.GenerateResponse) -> ChoiceUpdate:
        """The update for one engine response; `finished` is set when the
        engine finished or a stop string matched (the caller then cancels)."""
        if self.num_cached_tokens is None:
            self.num_cached_tokens = resp.num_cached_tokens
        stop_str = self._decode(resp.token_ids)
        self.num_tokens += len(resp.token_ids)
        update = ChoiceUpdate(self.index, "", list(resp.token_ids))
        if self.want_logprobs:
            update.logprobs = [self._logprob(entry) for entry in resp.logprobs]
        if stop_str is not None:
            update.finish_reason, update.stop_reason = "stop", stop_str
        elif resp.finish_reason:
            update.finish_reason = resp.finish_reason
            update.stop_reason = resp.stop_token_id if resp.HasField("stop_token_id") else None
        self.finished = update.finish_reason is not None
        update.text = self._next_text()
        return update

    def _decode(self, token_ids) -> str | None:
        """Decode new tokens one at a time, noting where each starts; the stop string that
        ended the text, if one did (tokens past it start at the text's end)."""
        for i, token_id in enumerate(token_ids):
            self.text_offsets.append(len(self.detokenizer.output_text))
            stop_str = self.detokenizer.update((token_id,))
            if stop_str is not None:
                end = len(self.detokenizer.output_text)  # cut at the stop string: clamp what now lies past it
                self.text_offsets = [min(o, end) for o in self.text_offsets]
                self.text_offsets.extend([end] * (len(token_ids) - i - 1))
                return stop_str
        return None

    def _next_text(self) -> str:
        text = self.detokenizer.output_text
        end = len(text) if self.finished else max(self.num_sent_chars, len(text) - self.holdback)
        delta = text[self.num_sent_chars:end]
        self.num_sent_chars = end
        return delta

    def _logprob(self, entry: epb.TokenLogprobs) -> TokenLogprob:
        sampled, *top = entry.entries
        decode = self.detokenizer.decode_token
        return TokenLogprob(
            sampled.token_id, decode(sampled.token_id), sampled.logprob,
            [(e.token_id, decode(e.token_id), e.logprob) for e in top],
        )
