"""A session mutation's plan (session.py): the text and literal changes as values, computed before anything is
mutated, and the record splice that repair.py certifies; `Session._commit` applies it."""

from __future__ import annotations

from dataclasses import dataclass

from .nfcmap import NfcMap
from .repair import RecordSplice
from .textstore import TextChange

# A literal entry: (raw_start, raw_end, norm_start, norm_end, id), id = -1 for a literal that is not allowed.
LiteralEntry = tuple[int, int, int, int, int]
Literals = list[LiteralEntry] | tuple[LiteralEntry, ...]
NO_LITERALS: tuple[LiteralEntry, ...] = ()     # shared by every session without literal matches (a list is 56 bytes)


@dataclass(frozen=True)
class ReplaceLiteralsFrom:
    """Literal entries from index `keep` on are replaced by `added` (an append rescans only the tail)."""
    keep: int
    added: list[LiteralEntry]

    def apply(self, entries: Literals) -> Literals:
        if not self.keep and not self.added:
            return NO_LITERALS
        if isinstance(entries, tuple):      # the shared empty entries of a session that had none
            entries = list(entries)
        del entries[self.keep:]
        entries.extend(self.added)
        return entries


@dataclass(frozen=True)
class SetLiterals:
    entries: list[LiteralEntry]

    def apply(self, entries: Literals) -> Literals:
        return self.entries or NO_LITERALS


@dataclass
class Plan:
    """Everything a mutation changes, computed before anything is mutated."""
    raw_change: TextChange
    norm_change: TextChange | None              # None: the normalized text equals the raw text
    lits: ReplaceLiteralsFrom | SetLiterals | None    # None: literal entries unchanged
    nmap: NfcMap | None = None                  # the NFC map after the change (None: unchanged)
    records: RecordSplice | None = None         # filled by the repair
