"""Fonts for token text in plots: a CJK-capable font when one is installed, readable escapes when not.

matplotlib's default font (DejaVu Sans) has no CJK glyphs and would draw "是" as an empty box. So
before drawing labels we look for an installed font that has every character needed (preferring
well-known CJK families) and put it first in the font family list, DejaVu Sans after it for the
rest. When no installed font has some characters, those characters are drawn as their code
points (``U+662F``) and the caller is told once, with the fix.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

from matplotlib import font_manager, ft2font, rcParams

#: Checked first, in this order; any other installed font with the glyphs also works.
PREFERRED_FAMILIES = (
    "Noto Sans CJK SC", "Noto Sans CJK JP", "Noto Sans SC", "Source Han Sans SC", "Source Han Sans CN",
    "WenQuanYi Zen Hei", "WenQuanYi Micro Hei", "Droid Sans Fallback", "Sarasa Gothic SC", "SimHei",
    "Microsoft YaHei", "PingFang SC", "Hiragino Sans GB", "AR PL UMing CN", "Arial Unicode MS",
)  # fmt: skip
#: How to get real glyphs; shown in the figure itself (which cannot show the characters) too.
FIX = "shown as U+XXXX code points; install a CJK font (e.g. Debian's fonts-noto-cjk) to see them"
#: Fonts whose glyphs are placeholders, not characters.
_PLACEHOLDER_FONTS = ("Last Resort",)


@dataclass(frozen=True)
class LabelFont:
    """The font family list for token labels and the characters it cannot draw."""

    families: tuple[str, ...]
    missing: frozenset[str]

    @property
    def note(self) -> str | None:
        """What was replaced and how to fix it (for a terminal); None when nothing was."""
        if not self.missing:
            return None
        shown = "".join(sorted(self.missing)[:12]) + ("…" if len(self.missing) > 12 else "")
        return f"no installed font has glyphs for {len(self.missing)} character(s) ({shown}): in plots they are {FIX}"

    def label(self, text: str) -> str:
        """``text`` with each character this font cannot draw written as its code point, set apart
        from its neighbours by spaces (U+662F U+7684, 1+1=2 U+FF1F)."""
        if not self.missing:
            return text
        parts = [f" U+{ord(ch):04X} " if ch in self.missing else ch for ch in text]
        return " ".join("".join(parts).split(" ")).strip().replace("  ", " ")


def label_font(texts: Iterable[str]) -> LabelFont:
    """The best font family list for drawing all of ``texts``."""
    default = _default_font_path()
    needed = {ch for text in texts for ch in text if not ch.isspace()}
    missing = {ch for ch in needed if ord(ch) not in _charmap(default)}
    if not missing:
        return LabelFont(tuple(rcParams["font.family"]), frozenset())
    best_name, best_missing = None, missing
    for name, path in _candidate_fonts():
        left = {ch for ch in best_missing if ord(ch) not in _charmap(path)}
        if len(left) < len(best_missing):
            best_name, best_missing = name, left
            if not left:
                break
    families = ((best_name,) if best_name else ()) + (font_manager.FontProperties(fname=default).get_name(),)
    return LabelFont(families, frozenset(best_missing))


def _default_font_path() -> str:
    return font_manager.findfont(font_manager.FontProperties(family=rcParams["font.family"]))


def _candidate_fonts() -> list[tuple[str, str]]:
    """(family name, file) of installed fonts, preferred CJK families first."""
    fonts = {
        entry.name: entry.fname
        for entry in font_manager.fontManager.ttflist
        if not any(entry.name.startswith(p) for p in _PLACEHOLDER_FONTS)
    }
    rank = {name: i for i, name in enumerate(PREFERRED_FAMILIES)}
    return sorted(fonts.items(), key=lambda item: rank.get(item[0], len(rank)))


@functools.lru_cache(maxsize=None)
def _charmap(path: str) -> frozenset[int]:
    try:
        return frozenset(ft2font.FT2Font(path).get_charmap())
    except (OSError, RuntimeError):
        return frozenset()
