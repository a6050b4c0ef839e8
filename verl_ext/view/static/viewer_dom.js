// verl-ext view: making the page's elements and the text of its numbers. Every string from the trace
// (tokens, prompts, paths, uids) is shown with textContent, never as markup.
(function (viewer) {
  "use strict";

  function $(id) { return document.getElementById(id); }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "text") node.textContent = String(value);
      else if (name === "class") node.className = value;
      else node.setAttribute(name, String(value));
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.appendChild(typeof child === "string" || typeof child === "number" ? document.createTextNode(String(child)) : child);
    }
    return node;
  }

  function clear(node) { node.replaceChildren(); return node; }

  function fmt(x, digits) {
    if (x === null || x === undefined) return "—";
    if (typeof x !== "number") return String(x);
    if (Number.isNaN(x)) return "NaN";
    if (!Number.isFinite(x)) return x > 0 ? "+inf" : "−inf";
    if (Number.isInteger(x) && Math.abs(x) < 1e6) return String(x);
    const a = Math.abs(x);
    if (a !== 0 && (a < 1e-3 || a >= 1e5)) return x.toExponential(2);
    return x.toFixed(digits === undefined ? 4 : digits);
  }

  function link(text, changes, attrs) {
    return el("a", Object.assign({ href: viewer.hrefFor(changes), text: text }, attrs || {}));
  }

  Object.assign(viewer, { $: $, el: el, clear: clear, fmt: fmt, link: link });
})(window.verlExtViewer);
