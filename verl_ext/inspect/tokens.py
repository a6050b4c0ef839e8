"""Token ids to the text a person reads.

The tokenizer is loaded from local files only (``local_files_only=True``: never the network), from
the run record's ``tokenizer_path`` or a path the user gives; without one, tokens show as ``#id``.

Per-token text: each id is decoded on its own. A byte-level tokenizer may split one character
(often a CJK character: three UTF-8 bytes) over several tokens, each of which alone decodes to
U+FFFD; such a run is decoded together, the character is shown on the run's first token and the
following tokens show :data:`CONTINUATION`. Invisible characters are escaped (``\\n``, ``␣``).
"""

from __future__ import annotations

import unicodedata
from typing import Sequence

#: Shown for a token that only carries the remaining bytes of the previous token's character.
CONTINUATION = "<+>"
#: Shown for a token that decodes to nothing.
EMPTY = "∅"
_REPLACEMENT = "\ufffd"
_MAX_BYTES_PER_CHARACTER = 4
_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def visible(text: str, show_spaces: bool = True) -> str:
    """``text`` with line breaks, tabs and other control characters escaped (spaces as ␣ if asked)."""
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ch == " " and show_spaces:
            out.append("␣")
        elif unicodedata.category(ch) in ("Cc", "Cf") and ch != " ":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


class TokenDecoder:
    """Decodes token ids with a Hugging Face tokenizer, or shows ids when there is none."""

    def __init__(self, tokenizer=None, source: str | None = None, problem: str | None = None):
        self.tokenizer = tokenizer
        self.source = source
        #: Why there is no tokenizer (None when there is one).
        self.problem = problem

    @classmethod
    def load(cls, path: str | None) -> "TokenDecoder":
        """Load ``AutoTokenizer.from_pretrained(path, local_files_only=True)``; on any failure a
        decoder that shows ids, with ``problem`` saying why."""
        if not path:
            return cls(problem="no tokenizer: the run record names none and none was given")
        try:
            from transformers import AutoTokenizer
            from transformers.utils import logging as hf_logging

            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # its own warnings would break the one-line contract
            try:
                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            finally:
                hf_logging.set_verbosity(verbosity)
        except Exception as exc:  # noqa: BLE001 - any failure means the same thing: show ids
            from verl_ext.trace.storage import one_line

            return cls(problem=f"cannot load tokenizer {path} ({one_line(exc)[:160]})")
        return cls(tokenizer, source=path)

    @property
    def available(self) -> bool:
        return self.tokenizer is not None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def text(self, ids: Sequence[int]) -> str | None:
        """The decoded text of ``ids``; None without a tokenizer."""
        return self._decode(ids) if self.available else None

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """One display string per token (see the module docstring)."""
        ids = [int(i) for i in ids]
        if not self.available:
            return [f"#{i}" for i in ids]
        out: list[str] = []
        i = 0
        while i < len(ids):
            text = self._decode(ids[i : i + 1])
            run = 1
            if _REPLACEMENT in text:
                for length in range(2, min(_MAX_BYTES_PER_CHARACTER, len(ids) - i) + 1):
                    joined = self._decode(ids[i : i + length])
                    if _REPLACEMENT not in joined:
                        text, run = joined, length
                        break
            out.append(visible(text) if text else EMPTY)
            out.extend([CONTINUATION] * (run - 1))
            i += run
        return out


def decoder_for(trace, tokenizer=None) -> TokenDecoder:
    """The decoder to use: ``tokenizer`` as given (a TokenDecoder, a Hugging Face tokenizer or a
    path), else the run record's ``tokenizer_path``."""
    if isinstance(tokenizer, TokenDecoder):
        return tokenizer
    if tokenizer is None or isinstance(tokenizer, str):
        return TokenDecoder.load(tokenizer or trace.record.get("tokenizer_path"))
    return TokenDecoder(tokenizer, source=getattr(tokenizer, "name_or_path", None))
