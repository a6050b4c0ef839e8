// verl-ext view: the colours of the tokens and the legend that reads them.
(function (viewer) {
  "use strict";

  const { CLIP_CODES, CLIP_COLOURS, CLIP_NONE, $, el, clear, fmt, decode, valueOf, scaleKey } = viewer;
  // Token colours are classes c-20 … c20 (see colourRules).
  const STEPS = 20;

  // Token colours are classes (a style attribute on each of thousands of tokens is slow to apply):
  // c-20 … c20 for (x − centre)/scale rounded to twentieths, clip-<code>, c-inf; their rules are made
  // here, into the page's own style sheet, from the same function the legend uses.
  function colourRules() {
    const sheet = document.querySelector("style").sheet;
    for (let k = -STEPS; k <= STEPS; k++) {
      sheet.insertRule(`.tok.c${k} { background-color: ${diverging(k / STEPS)};${Math.abs(k / STEPS) > 0.65 ? " color: #fff;" : ""} }`, sheet.cssRules.length);
    }
    for (const code of CLIP_CODES) {
      sheet.insertRule(`.tok.clip-${code} { background-color: ${CLIP_COLOURS[code]};${code === CLIP_NONE ? "" : " color: #fff;"} }`, sheet.cssRules.length);
    }
    sheet.insertRule(".tok.c-inf { background-color: #000; color: #fff; }", sheet.cssRules.length);
  }

  // t in [−1, 1] to −STEPS … STEPS; a value off the centre is at least one step off, so its sign shows.
  function shade(t) {
    if (t === 0) return 0;
    return Math.sign(t) * Math.max(1, Math.min(STEPS, Math.round(Math.abs(t) * STEPS)));
  }

  function paint(span, colour) {
    if (span._colour === colour) return;
    if (span._colour) span.classList.remove(span._colour);
    if (colour) span.classList.add(colour);
    span._colour = colour;
  }

  function diverging(t) {
    // t in [−1, 1]: blue (#2166ac) … white … red (#b2182b)
    const u = Math.min(1, Math.abs(t));
    const target = t < 0 ? [33, 102, 172] : [178, 24, 43];
    const c = target.map((v) => Math.round(255 + (v - 255) * u));
    return `rgb(${c[0]}, ${c[1]}, ${c[2]})`;
  }

  function colourTokens(view) {
    const q = view.q;
    const response = $("response");
    response.setAttribute("data-colour", q ? q.key : "");
    const legend = clear($("legend"));
    if (!q) return;
    const spans = [...view.spans];
    // the valid tokens; and the rejected ones (the policy's, left out by verl's rollout correction) for a
    // quantity defined on every token the policy wrote (q.own: the log-ratio, the weight)
    const mask = decode(view.chunk.mask), rejected = q.own ? decode(view.chunk.rejected) : null;
    const shown = (row) => mask[row] === 1 || (rejected !== null && rejected[row] === 1);
    const values = spans.map((span, i) => (shown(view.begin + i) ? valueOf(q, view.chunk, view.begin + i, view.epoch) : null));
    if (q.levels) { viewer.colourLevels(view, q, spans, values, legend); return; }  // a response's version or staleness (viewer_versions.js)
    if (q.categorical) {
      spans.forEach((span, i) => paint(span, values[i] === null || !(values[i] in CLIP_COLOURS) ? null : `clip-${values[i]}`));
      legend.appendChild(document.createTextNode(`${q.label}, epoch ${view.epoch}:`));
      for (const code of CLIP_CODES) {
        const swatch = el("span", { class: "swatch" });
        swatch.style.backgroundColor = CLIP_COLOURS[code];
        legend.appendChild(swatch);
        legend.appendChild(document.createTextNode(code));
      }
      return;
    }
    const centre = q.centre || 0;
    const stepScales = Object.assign({}, view.info.scales, view.stats ? view.stats.scales : {});
    let scale = stepScales[scaleKey(q, view.epoch)];
    let over = `step ${view.step}`;
    if (scale === undefined || scale === null) {
      scale = 0;
      for (const v of values) if (v !== null && Number.isFinite(v)) scale = Math.max(scale, Math.abs(v - centre));
      over = "this response";
    }
    spans.forEach((span, i) => {
      const v = values[i];
      if (v === null || scale === 0) paint(span, null);
      else if (!Number.isFinite(v)) paint(span, "c-inf");
      else paint(span, `c${shade((v - centre) / scale)}`);
    });
    legend.setAttribute("data-scale", scale);
    legend.appendChild(document.createTextNode(`${q.label}${q.kind === "update" ? `, epoch ${view.epoch}` : ""}: `));
    legend.appendChild(el("span", { class: "num", text: fmt(centre - scale, 3) }));
    const bar = el("span", { class: "bar" });
    bar.style.background = `linear-gradient(to right, ${diverging(-1)}, #fff, ${diverging(1)})`;
    legend.appendChild(bar);
    legend.appendChild(el("span", { class: "num", text: fmt(centre + scale, 3) }));
    legend.appendChild(el("span", { class: "muted", text: ` (±the largest |x${centre ? ` − ${centre}` : ""}| over ${over})` }));
  }

  Object.assign(viewer, { colourRules: colourRules, colourTokens: colourTokens, paint: paint, diverging: diverging, shade: shade });
})(window.verlExtViewer);
