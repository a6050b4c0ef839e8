// verl-ext view: a note when this machine has no font for characters of the trace (the browser would
// draw them as empty boxes). viewer.js checks what it drew; renderHeader puts the note back.
(function (viewer) {
  "use strict";

  const { $, el } = viewer;
  let missingGlyphs = null;  // the characters shown that this machine has no glyph for (see checkGlyphs)

  // Without a CJK font the browser draws CJK text as empty boxes (the font's missing glyph), which
  // reads as data. A character drawn exactly as a code point no font covers (U+10FFFD, private use)
  // has no glyph here: the page says so once, with what to install.
  const CJK = /[\p{Script=Han}\p{Script=Hiragana}\p{Script=Katakana}\p{Script=Hangul}]/gu;
  const NO_FONT_HAS = "\u{10FFFD}";
  const glyphless = new Map();  // character -> true when this machine has no glyph for it

  function pixels(text, font) {
    const canvas = document.createElement("canvas");
    canvas.width = canvas.height = 48;
    const context = canvas.getContext("2d", { willReadFrequently: true });
    context.font = font;
    context.textBaseline = "middle";
    context.fillText(text, 4, 24);
    return context.getImageData(0, 0, 48, 48).data;
  }

  function samePixels(a, b) {
    for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
    return true;
  }

  async function checkGlyphs(text) {
    if (missingGlyphs) return;
    // a bounded look per drawing (a long Chinese text has thousands of distinct characters)
    const fresh = [...new Set(text.match(CJK) || [])].filter((c) => !glyphless.has(c)).slice(0, 64);
    if (!fresh.length) return;
    await document.fonts.ready;  // a font still loading is not a missing one
    const font = `32px ${getComputedStyle($("response")).fontFamily}`;
    const box = pixels(NO_FONT_HAS, font);
    for (const c of fresh) glyphless.set(c, samePixels(pixels(c, font), box));
    const missing = [...glyphless].filter(([, none]) => none).map(([c]) => c);
    document.body.dataset.glyphless = missing.join("");  // what was found (tests wait for it)
    if (!missing.length || missingGlyphs) return;
    missingGlyphs = missing;
    $("notes").appendChild(glyphNote());
  }

  function glyphNote() {
    const shown = missingGlyphs.slice(0, 6).join(" ");
    return el("div", { class: "note", id: "glyph-note", text: `note: this machine has no font for CJK characters of the trace (${shown}${missingGlyphs.length > 6 ? " …" : ""}): the browser draws them as empty boxes. Install one (Debian, Ubuntu: apt-get install fonts-noto-cjk) and reload the page.` });
  }

  // The note again, in the notes renderHeader has just cleared, once characters were found missing.
  function appendGlyphNote(notes) {
    if (missingGlyphs) notes.appendChild(glyphNote());
  }

  Object.assign(viewer, { checkGlyphs: checkGlyphs, appendGlyphNote: appendGlyphNote });
})(window.verlExtViewer);
