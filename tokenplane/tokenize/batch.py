"""`Tokenizer.encode_batch`: many texts, in order, each one's IDs equal to its own `encode`.

Short texts are what a batch of chat messages, tool results or snippets to count is made of, and one `encode` of a
~110-character text takes ~6 us around ~1.5 us of encoding: the Python layers of the call, the guard, and the AOT
kernel call. A batch without allowed special tokens therefore joins its short texts (each up to GROUP_TEXT_CHARS)
into groups of under `segments.MAX_CHARS` characters, normalizes a group at once where the family normalizes
(naming a failing text by its index), and encodes each group with one call of cpu/fullbatch.py: the stages of the
family's fused block kernel on each text as a text of its own, so each text's IDs are its own encode's. What that
call declines (a lone surrogate, a byte the vocabulary lacks, a path that is not the CPU encoder) goes text by text
through `encode`, which raises for a bad text with its index. Groups and longer texts are the batch's units of
work, pulled in order by the calling thread and pool threads (docs/pretokenizer.md, "Batches of short texts", has
the figures).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .cpu.parallel import default_workers
from .cpu.segments import MAX_CHARS as SEGMENT_SPAN_CHARS
from .errors import InvalidTextError, TextTooLargeError, validate_text
from .router import segment_encoder

if TYPE_CHECKING:
    from .tokenizer import EncodePath, Tokenizer

GROUP_TEXT_CHARS = 16 * 1024        # texts up to this join a group; longer ones are encoded on their own
BATCH_SERIAL_CHARS = 64 * 1024      # below this much text in all, the batch runs on the calling thread
_NO_IDS = np.zeros(0, dtype=np.uint32)


def _indexed(i: int, exc: Exception) -> Exception:
    exc.index = i  # type: ignore[attr-defined]
    exc.add_note(f"(text {i} of the batch)")
    return exc


def encode_batch(tok: Tokenizer, items: Sequence[str | bytes], allowed: frozenset[str], path: EncodePath,
                 workers: int, pool: Callable[[int], ThreadPoolExecutor]) -> list[np.ndarray]:
    """IDs of every text of `items`, in order (see the module docstring); `pool(k)`: an executor with k threads."""
    out: list[np.ndarray] = [_NO_IDS] * len(items)

    def one(i: int) -> None:
        try:
            out[i] = tok.encode(items[i], allowed_special=allowed, path=path)
        except (InvalidTextError, TextTooLargeError) as exc:
            raise _indexed(i, exc) from None

    def group(members: list[int]) -> None:
        texts = [items[i] for i in members]     # (strs, each within GROUP_TEXT_CHARS and max_chars)
        joined = "".join(texts)
        # A lone surrogate: the kernel's code point reader declines the group, whose texts then go one by one
        # through `encode` (which names the failing text). Only a normalizer must not see one: it checks each
        # text that could hold one first (plain NFC: those with a non-inert code point, which a surrogate is).
        if tok.family.normalizer is not None and not joined.isascii():
            def check(k: int) -> None:
                try:
                    validate_text(texts[k], tok.max_chars)
                except InvalidTextError as exc:
                    raise _indexed(members[k], exc) from None

            normal = tok.normalize_texts(texts, joined, check)  # each text as its own encode normalizes it
            if normal is not texts:
                texts, joined = normal, "".join(normal)
        lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        ends = np.cumsum(lengths)
        spans = np.stack((ends - lengths, ends), axis=1)
        cpu = segment_encoder(tok.path(path), int(lengths.max()))
        got = None if cpu is None else cpu.encode_texts(joined, spans)
        if got is None:
            for i in members:
                one(i)
            return
        ids, cut = got[0], np.cumsum(got[1]).tolist()
        for i, a, b in zip(members, [0, *cut], cut):
            out[i] = ids[a:b]

    units: list[Callable[[], None]] = []
    members: list[int] = []
    size = total = 0
    limit = -1 if allowed else min(GROUP_TEXT_CHARS, tok.max_chars)     # (allowed specials: every text alone)
    for i, text in enumerate(items):
        if not isinstance(text, str):
            units.append(partial(one, i))
            total += len(text) if isinstance(text, (bytes, bytearray, memoryview)) else 0
            continue
        n = len(text)
        total += n
        if n > limit:
            units.append(partial(one, i))
            continue
        if members and size + n >= SEGMENT_SPAN_CHARS:
            units.append(partial(group, members))
            members, size = [], 0
        members.append(i)
        size += n
    if members:
        units.append(partial(group, members))

    workers = max(1, min(workers, len(units), default_workers()))     # (more threads than cores only queue)
    if workers == 1 or total < BATCH_SERIAL_CHARS:
        for unit in units:
            unit()
        return out
    # The calling thread and workers - 1 long-lived pool threads (each keeps its piece caches warm from batch to
    # batch; fresh threads start empty, and measured slower on two threads than one) pull units in order from one
    # queue: a thread that finishes early takes the next unit instead of idling behind a fixed share.
    queue = iter(units)
    lock = threading.Lock()

    def drain() -> None:
        while True:
            with lock:
                unit = next(queue, None)
            if unit is None:
                return
            unit()

    executor = pool(workers - 1)
    futures = [executor.submit(drain) for _ in range(1, workers)]
    try:
        drain()
    finally:
        for f in futures:       # every thread ends (or raises) before this call returns
            f.result()
    return out
