"""Gateway outputs -> OpenAI response objects (completions and chat)."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.request import ChoiceUpdate, TokenLogprob, Usage


def usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def completion_logprobs(entries: list[TokenLogprob], text_offsets: Sequence[int]) -> dict:
    """The legacy completions shape: parallel lists, one entry per token. `text_offsets`: where
    each token's text starts in the choice's text (ChoiceState.text_offsets), not the tokens'
    own lengths: a token may decode to nothing (part of a character) or to more than its text."""
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{text: lp for _, text, lp in e.top} or {e.token: e.logprob} for e in entries],
        "text_offset": list(text_offsets),
    }


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    def item(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [
        {**item(e.token, e.logprob), "top_logprobs": [item(text, lp) for _, text, lp in e.top]} for e in entries
    ]}


def _stop_reason(update: ChoiceUpdate):
    return update.stop_reason


def completion_choice(update: ChoiceUpdate, want_logprobs: bool, text_offsets: Sequence[int] = ()) -> dict:
    return {
        "index": update.index,
        "text": update.text,
        "logprobs": completion_logprobs(update.logprobs, text_offsets) if want_logprobs else None,
        "finish_reason": update.finish_reason,
        "stop_reason": _stop_reason(update),
    }


def chat_choice(update: ChoiceUpdate, want_logprobs: bool) -> dict:
    return {
        "index": update.index,
        "message": {"role": "assistant", "content": update.text},
        "logprobs": chat_logprobs(update.logprobs) if want_logprobs else None,
        "finish_reason": update.finish_reason,
        "stop_reason": _stop_reason(update),
    }


def chat_chunk_choice(update: ChoiceUpdate, want_logprobs: bool, first: bool) -> dict:
    delta = {"role": "assistant", "content": update.text} if first else {"content": update.text}
    return {
        "index": update.index,
        "delta": delta,
        "logprobs": chat_logprobs(update.logprobs) if want_logprobs else None,
        "finish_reason": update.finish_reason,
    }
