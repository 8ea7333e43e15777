"""Text out for upstreams that answer token IDs only: the tier owns detokenization too.

An engine started without a tokenizer (vLLM or SGLang `--skip-tokenizer-init`) takes token-ID prompts and answers
token IDs with empty text (upstream_fields says how they are asked for). In front of one, the tier turns each
choice's IDs into text with its own tokenizer (text_stream.TextStream: whole UTF-8 characters, special tokens
skipped as vLLM's skip_special_tokens does, stop strings matched here and cut as vLLM cuts them), writes the
logprobs a client asked for as text (the upstream answers them in token-ID form), and drops the IDs the client did
not ask for. What this buys: vLLM primes its detokenizer with the whole prompt on every request
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

from .errors import APIError
from .text_stream import TextStream, completion_logprobs

_PLACEHOLDER = "token_id:"


def upstream_fields(body: dict[str, Any], req: Any, ids_in_answer: bool = False) -> dict[str, Any]:
    """The upstream request's fields for an ID-only upstream: IDs back, always streamed with usage; stop strings
    stay here (a tokenizer-less engine cannot match text).

    Over HTTP the IDs come as the sampled token's logprob entry written as an ID (`logprobs: 0` with
    `return_tokens_as_token_ids`: "token_id:N"), not through `return_token_ids`: vLLM's `return_token_ids` also
    echoes the whole prompt's IDs in the first chunk, which vLLM serializes and the tier parses, O(context) per turn
    (~35 ms at 314K tokens, ~130 ms at 1M on this machine: benchmarks/results/agent_ttft_sw4096_ids*.md). An answer
    whose chunks carry `token_ids` is read too. An upstream whose answers carry IDs anyway (`ids_in_answer`: gRPC)
    is asked for logprobs only when the client asked. A client's logprobs are asked with its count and come back
    in the token-ID form, which `IdAnswer` writes as text."""
    out = {k: v for k, v in body.items() if k not in ("stop", "stream", "stream_options", "logprobs")}
    if req.num_logprobs is not None:
        out["logprobs"] = req.num_logprobs
    elif not ids_in_answer:
        out["logprobs"] = 0
    out.update(return_tokens_as_token_ids=True, stream=True, stream_options={"include_usage": True})
    return out


def _token_id(token: Any) -> int:
    if not (isinstance(token, str) and token.startswith(_PLACEHOLDER)):
        raise ValueError(token)
    return int(token[len(_PLACEHOLDER):])


def _bad_ids(lp: Any) -> APIError:
    return APIError(f"the upstream's logprobs tokens are not token IDs ('token_id:N'): is it started without its "
                    f"tokenizer? {str(lp)[:200]}", status=502, code="upstream_error")


def _ids(choice: dict[str, Any]) -> tuple[list[int], Any]:
    """A chunk choice's new token IDs (`token_ids`, else its logprobs' tokens written as IDs, "token_id:N") and its
    logprobs as the upstream sent them (taken out of the choice)."""
    ids = choice.pop("token_ids", None)
    lp = choice.get("logprobs")
    choice["logprobs"] = None
    if ids is not None:
        return list(ids), lp
    if not lp:
        return [], lp
    try:
        return [_token_id(t) for t in lp.get("tokens") or ()], lp
    except (TypeError, ValueError, AttributeError) as e:
        raise _bad_ids(lp) from e


class IdAnswer:
    """One request's answer: upstream completion chunks (token IDs, empty text) in, completion chunks with text out.

    `convert` takes a parsed upstream chunk and returns it with each choice's text filled in (IDs removed), plus
    whether every choice has now finished; a choice that met a stop string here gets finish_reason "stop" and
    stop_reason the string, as vLLM reports it."""

    def __init__(self, tokenizer: Any, stops: list[str], n_prompt: int, n_choices: int = 1,
                 logprobs: int | None = None, min_tokens: int = 0, include_stop: bool = False,
                 skip_special: bool = True) -> None:
        self.tokenizer, self.stops, self.n_prompt = tokenizer, stops, n_prompt
        self.min_tokens = min_tokens          # no stop string ends a choice before this many tokens (vLLM's)
        self.include_stop, self.skip_special = include_stop, skip_special   # vLLM's text options (TextStream)
        self.logprobs = logprobs              # the client's count, None: it asked for none
        self.offsets: dict[int, int] = {}     # per choice: characters of its token texts so far (text_offset)
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
            s = self.streams[i] = TextStream(self.tokenizer, self.stops, skip_special=self.skip_special,
                                             include_stop=self.include_stop)
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
            ids, lp = _ids(c)
            if i in self.finished:
                continue   # a choice this tier already ended on a stop string: the rest is not its answer
            if self.logprobs is not None and ids:
                c["logprobs"] = self._logprobs(i, ids, lp)
            s = self._stream(i)
            self.tokens[i] = self.tokens.get(i, 0) + len(ids)
            text = s.push(ids, armed=self.tokens[i] >= self.min_tokens)
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

    def _logprobs(self, i: int, ids: list[int], lp: Any) -> dict[str, Any]:
        """The client's completion logprobs for choice i's new tokens, from the upstream's token-ID form: every
        token and top-logprob key written as its text, text offsets counted in this choice's tokens."""
        if not isinstance(lp, dict) or len(lp.get("token_logprobs") or ()) != len(ids):
            raise APIError(f"the upstream sent no logprobs for {len(ids)} token(s) the client asked them for: "
                           f"{str(lp)[:200]}", status=502, code="upstream_error")
        tops = lp.get("top_logprobs") or [None] * len(ids)
        try:
            entries = [(t, v, None if top is None else [(_token_id(k), x) for k, x in top.items()])
                       for t, v, top in zip(ids, lp["token_logprobs"], tops)]
        except (TypeError, ValueError, AttributeError) as e:
            raise _bad_ids(lp) from e
        out, self.offsets[i] = completion_logprobs(self.tokenizer, entries, self.offsets.get(i, 0))
        return out

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
    logprobs: dict[int, dict[str, list[Any]]] = {}
    async for data in chunks:
        for c in data.get("choices") or ():
            i = c.get("index", 0)
            texts.setdefault(i, []).append(c.get("text", ""))
            if answer.logprobs is not None:
                into = logprobs.setdefault(i, {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                               "text_offset": []})
                for k, v in (c.get("logprobs") or {}).items():
                    into[k] += v
            if c.get("finish_reason") is not None:
                finish[i], stop_reason[i] = c["finish_reason"], c.get("stop_reason")
        if answer.ended_here:
            break
    choices = [{"index": i, "text": "".join(texts[i]), "logprobs": logprobs.get(i), "finish_reason": finish.get(i),
                "stop_reason": stop_reason.get(i)} for i in sorted(texts)]
    return {"id": answer.meta.get("id", ""), "object": "text_completion",
            "created": answer.meta.get("created", int(time.time())), "model": answer.meta.get("model"),
            "choices": choices, "usage": answer.usage or answer.counted_usage()}


__all__ = ["IdAnswer", "gathered", "upstream_fields"]
