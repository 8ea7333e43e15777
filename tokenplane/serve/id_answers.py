"""Text out for upstreams that answer token IDs only: the tier owns detokenization too.

An engine started without a tokenizer (vLLM or SGLang `--skip-tokenizer-init`) takes token-ID prompts and answers
token IDs with empty text (upstream_fields says how they are asked for). In front of one, the tier turns each
choice's IDs into text with its own tokenizer (text_stream.TextStream: whole UTF-8 characters, special tokens
skipped as vLLM's skip_special_tokens does, stop strings matched here and cut as vLLM cuts them) and drops the IDs the
client did not ask for. What this buys: vLLM primes its detokenizer with the whole prompt on every request
(`DecodeStream(ids=prompt)`, decoded on the first output token), O(context) per turn, ~0.15 s at 290K tokens on
this machine (benchmarks/results/agent_ttft*.md); a tokenizer-less engine skips it, and the tier's incremental
decoding costs O(new tokens).

The upstream request always streams with usage (a non-streaming client's answer is gathered here), so a stop string
found here ends the upstream request at once (the relay closes the connection and vLLM aborts it) instead of
decoding on to max_tokens; its usage is then counted here: the prompt's tokens and the tokens received up to the one
that completed the stop.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from .errors import APIError, InvalidRequest
from .text_stream import TextStream

_PLACEHOLDER = "token_id:"


def upstream_fields(body: dict[str, Any], req: Any) -> dict[str, Any]:
    """The upstream request's fields for an ID-only upstream: IDs back, always streamed with usage; stop strings
    stay here (a tokenizer-less engine cannot match text).

    The IDs come as the sampled token's logprob entry written as an ID (`logprobs: 0` with
    `return_tokens_as_token_ids`: "token_id:N"), not through `return_token_ids`: vLLM's `return_token_ids` also
    echoes the whole prompt's IDs in the first chunk, which vLLM serializes and the tier parses, O(context) per turn
    (~35 ms at 314K tokens, ~130 ms at 1M on this machine: benchmarks/results/agent_ttft_sw4096_ids*.md). An answer
    whose chunks carry `token_ids` is read too."""
    if req.num_logprobs is not None:
        raise InvalidRequest("logprobs need an upstream that has its tokenizer (this tier decodes token IDs from "
                             "tokenizer-less upstreams: --upstream-token-ids)", param="logprobs")
    out = {k: v for k, v in body.items() if k not in ("stop", "stream", "stream_options")}
    out.update(logprobs=0, return_tokens_as_token_ids=True, stream=True, stream_options={"include_usage": True})
    return out


def _ids(choice: dict[str, Any]) -> list[int]:
    """A chunk choice's new token IDs: `token_ids`, else its logprobs' tokens written as IDs ("token_id:N")."""
    ids = choice.pop("token_ids", None)
    lp = choice.get("logprobs")
    choice["logprobs"] = None   # the client asked for none (upstream_fields refuses logprobs)
    if ids is not None:
        return list(ids)
    if not lp:
        return []
    try:
        return [int(t[len(_PLACEHOLDER):]) for t in lp.get("tokens") or ()]
    except (TypeError, ValueError, AttributeError) as e:
        raise APIError(f"the upstream's logprobs tokens are not token IDs ('token_id:N'): is it started without its "
                       f"tokenizer? {str(lp)[:200]}", status=502, code="upstream_error") from e


class IdAnswer:
    """One request's answer: upstream completion chunks (token IDs, empty text) in, completion chunks with text out.

    `convert` takes a parsed upstream chunk and returns it with each choice's text filled in (IDs removed), plus
    whether every choice has now finished; a choice that met a stop string here gets finish_reason "stop" and
    stop_reason the string, as vLLM reports it."""

    def __init__(self, tokenizer: Any, stops: list[str], n_prompt: int, n_choices: int = 1) -> None:
        self.tokenizer, self.stops, self.n_prompt = tokenizer, stops, n_prompt
        self.streams: dict[int, TextStream] = {}
        self.tokens: dict[int, int] = {}      # output tokens received per choice (up to its end)
        self.finished: set[int] = set()
        self.n_choices = n_choices
        self.usage: dict[str, Any] | None = None
        self.meta: dict[str, Any] = {}
        self.cut = False   # a choice ended here on a stop string: the upstream is still decoding it

    def _stream(self, i: int) -> TextStream:
        s = self.streams.get(i)
        if s is None:
            s = self.streams[i] = TextStream(self.tokenizer, self.stops)
        return s

    @property
    def done(self) -> bool:
        return len(self.finished) >= self.n_choices

    @property
    def ended_here(self) -> bool:
        """Every choice has ended and at least one on a stop string found here: no usage chunk will come (the
        upstream request is closed)."""
        return self.cut and self.done

    def convert(self, data: dict[str, Any]) -> dict[str, Any]:
        for k in ("id", "created", "model"):
            if k in data and k not in self.meta:
                self.meta[k] = data[k]
        if data.get("usage"):
            self.usage = data["usage"]
        choices = []
        for c in data.get("choices") or ():
            i = c.get("index", 0)
            c.pop("prompt_token_ids", None)
            ids = _ids(c)
            if i in self.finished:
                continue   # a choice this tier already ended on a stop string: the rest is not its answer
            s = self._stream(i)
            text = s.push(ids)
            self.tokens[i] = self.tokens.get(i, 0) + len(ids)
            if s.stopped:
                c["finish_reason"], c["stop_reason"] = "stop", s.matcher.matched()
                self.cut = True
            elif c.get("finish_reason") is not None:
                text += s.flush()
            c["text"] = text
            if c.get("finish_reason") is not None:
                self.finished.add(i)
            choices.append(c)
        data["choices"] = choices
        return data

    def counted_usage(self) -> dict[str, Any]:
        """Usage for an answer this tier ended (the upstream's own usage chunk never came)."""
        out = sum(self.tokens.values())
        return {"prompt_tokens": self.n_prompt, "completion_tokens": out, "total_tokens": self.n_prompt + out}

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.meta.get("id", ""), "object": "text_completion", "created": self.meta.get(
            "created", int(time.time())), "model": self.meta.get("model"), "choices": [], "usage": self.counted_usage()}


async def gathered(answer: IdAnswer, chunks: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
    """A non-streaming completion from the converted chunks of a streamed upstream answer."""
    texts: dict[int, list[str]] = {}
    finish: dict[int, Any] = {}
    stop_reason: dict[int, Any] = {}
    async for data in chunks:
        for c in data.get("choices") or ():
            i = c.get("index", 0)
            texts.setdefault(i, []).append(c.get("text", ""))
            if c.get("finish_reason") is not None:
                finish[i], stop_reason[i] = c["finish_reason"], c.get("stop_reason")
        if answer.ended_here:
            break
    choices = [{"index": i, "text": "".join(texts[i]), "logprobs": None, "finish_reason": finish.get(i),
                "stop_reason": stop_reason.get(i)} for i in sorted(texts)]
    return {"id": answer.meta.get("id", ""), "object": "text_completion",
            "created": answer.meta.get("created", int(time.time())), "model": answer.meta.get("model"),
            "choices": choices, "usage": answer.usage or answer.counted_usage()}


__all__ = ["IdAnswer", "gathered", "upstream_fields"]
