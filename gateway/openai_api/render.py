"""Gateway outputs -> OpenAI response objects (completions and chat).

A chat request with tools reads each choice's text with its own tool-call
parser (gateway/tool_calls): the message, or the stream's deltas, are what
the parser makes of the text; the logprobs stay those of every generated
token, a call's text included (as vLLM's), each sent with the chunk of the
update it came in, even when the parser holds that text back.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.request import ChoiceUpdate, TokenLogprob, Usage
from gateway.tool_calls import StreamDelta, ToolCallParser, finish_reason


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


def chat_choice(update: ChoiceUpdate, want_logprobs: bool, parser: ToolCallParser | None = None) -> dict:
    """A whole choice; `parser`: its tool-call parser (None: the text is the content)."""
    message: dict = {"role": "assistant", "content": update.text}
    reason = update.finish_reason
    if parser is not None:
        output = parser.parse(update.text)
        message = output.to_openai_message()
        reason = None if reason is None else finish_reason(reason, output)
    return {
        "index": update.index,
        "message": message,
        "logprobs": chat_logprobs(update.logprobs) if want_logprobs else None,
        "finish_reason": reason,
        "stop_reason": _stop_reason(update),
    }


def chat_chunk_choice(update: ChoiceUpdate, want_logprobs: bool, first: bool) -> dict:
    delta = {"role": "assistant", "content": update.text} if first else {"content": update.text}
    return _chunk_choice(update.index, delta, chat_logprobs(update.logprobs) if want_logprobs else None,
                         update.finish_reason)


def tool_chunk_choices(update: ChoiceUpdate, want_logprobs: bool, first: bool, parser: ToolCallParser) -> list[dict]:
    """The chunks' choices of an update read by the choice's tool-call
    parser: what its text adds (with the role when first; none when it adds
    nothing and there is no logprob to carry); at the choice's end, what
    the parser held back, with the finish reason."""
    delta = parser.feed(update.text)
    choices = []
    if first or delta or (want_logprobs and update.logprobs):
        logprobs = chat_logprobs(update.logprobs) if want_logprobs else None
        choices.append(_chunk_choice(update.index, _role_first(delta, first), logprobs, None))
    if update.finish_reason is not None:
        last = parser.finish()
        reason = finish_reason(update.finish_reason, parser.result())
        choices.append(_chunk_choice(update.index, last.to_openai(), None, reason))
    return choices


def _role_first(delta: StreamDelta, first: bool) -> dict:
    return {"role": "assistant", **delta.to_openai()} if first else delta.to_openai()


def _chunk_choice(index: int, delta: dict, logprobs: dict | None, reason: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
