// verl-ext view: the page's script (no dependencies, no network beyond its own server in served mode).
// Every string from the trace (tokens, prompts, paths, uids) is shown with textContent, never as markup.
// State lives in the URL's hash (#step=5&sample=3&colour=value&epoch=0&filter=wrong&token=4), so a link
// shows the same thing and the browser's back button works.
(function () {
  "use strict";

  const DATA = JSON.parse(document.getElementById("verl-ext-data").textContent);
  const SERVED = DATA.mode === "served";
  // What the data's fields are, sent with the data from their records (verl_ext.view.payload.page_schema):
  // nothing here names a column, a summary field or a comparison statistic.
  const CLIP_CODES = DATA.clip_codes;  // the update tables' code columns (clip) index it
  const COLUMNS = DATA.float_columns;  // the token table's float columns, in the schema's order
  const UPDATE_COLUMNS = DATA.update_columns;  // [{name, kind: float | int | code | flag}], in the schema's order
  const UPDATE_KIND = Object.fromEntries(UPDATE_COLUMNS.map((c) => [c.name, c.kind]));
  const SUMMARY_FIELDS = DATA.summary_fields;  // [{key, label, digits}] of the summary row the step line shows
  // What a token can be coloured by: [{key, label, kind, name, centre?, categorical?}]. kind: column
  // (token table), delta (td0's re-estimate), update (the chosen PPO epoch's row), difference (of two
  // token columns); "estimate" (a re-estimated raw advantage) is added per estimator of the step.
  const BASE_QUANTITIES = DATA.quantities;
  const CLIP_COLOURS = DATA.clip_colours;  // clip code -> the colour of its tokens
  const CLIP_NONE = DATA.clip_none;  // the code of an unclipped token (light: dark text on it)
  const FILTERS = {
    all: () => true,
    wrong: (s) => s.wrong,
    truncated: (s) => s.truncated,
    clipped: (s) => s.clipped,
    nonfinite: (s) => s.nonfinite,
    tool: (s) => s.tool_calls > 0,
    notool: (s) => s.tool_calls === 0,
  };
  const NO_CODE = DATA.no_code;  // a code column's index where the code is null or unknown (a role no agent loop recorded)
  // Token colours are classes c-20 … c20 (see colourRules).
  const STEPS = 20;

  // ------------------------------------------------------------------ module state

  const cache = { steps: new Map(), chunks: new Map(), stats: new Map(), statsValue: new Map(), prompts: new Map() };
  const decoded = new WeakMap();  // an encoded array -> its typed array
  let RUN = DATA.run || null;  // served: the server puts the run in the page too (/api/run again lists new steps)
  let renderCount = 0;
  let pinned = null;  // the token span whose details show when the mouse is not on a token
  let current = null;  // the view the tokens on the page were drawn from
  let listKey = null;  // what the sample list was drawn for
  let missingGlyphs = null;  // the characters shown that this machine has no glyph for (see checkGlyphs)

  // ------------------------------------------------------------------ small helpers

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

  function decode(desc) {
    if (!desc) return null;
    let array = decoded.get(desc);
    if (array) return array;
    const binary = atob(desc.b);
    const bytes = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
    array = desc.t === "f4" ? new Float32Array(bytes.buffer) : desc.t === "i4" ? new Int32Array(bytes.buffer) : bytes;
    decoded.set(desc, array);
    return array;
  }

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

  function hrefFor(changes) { return "#" + encodeState(Object.assign({}, readState(), changes)); }

  function link(text, changes, attrs) {
    return el("a", Object.assign({ href: hrefFor(changes), text: text }, attrs || {}));
  }

  // ------------------------------------------------------------------ state in the hash

  function readState() {
    const params = new URLSearchParams(location.hash.slice(1));
    const num = (name) => (params.has(name) && params.get(name) !== "" && !Number.isNaN(Number(params.get(name))) ? Number(params.get(name)) : null);
    return {
      step: num("step"), sample: num("sample"), epoch: num("epoch"), token: num("token"),
      colour: params.get("colour") || BASE_QUANTITIES[0].key, filter: FILTERS[params.get("filter")] ? params.get("filter") : "all",
    };
  }

  function encodeState(state) {
    const params = new URLSearchParams();
    for (const name of ["step", "sample", "colour", "epoch", "filter", "token"]) {
      if (state[name] !== null && state[name] !== undefined) params.set(name, state[name]);
    }
    return params.toString();
  }

  function go(changes) { location.hash = encodeState(Object.assign({}, readState(), changes)); }

  // ------------------------------------------------------------------ data (inline, or from the server)

  async function fetchJSON(url) {
    const response = await fetch(url, { cache: "no-store" });
    const body = await response.json().catch(() => ({ error: `${url}: HTTP ${response.status}` }));
    if (!response.ok) throw new Error(body.error || `${url}: HTTP ${response.status}`);
    return body;
  }

  async function run() {
    if (!RUN) RUN = await fetchJSON("api/run");
    return RUN;
  }

  function stepsShown() { return SERVED ? RUN.steps : DATA.steps_in_file; }

  async function overview(step) {
    if (!SERVED) return DATA.steps[String(step)].overview;
    if (!cache.steps.has(step)) cache.steps.set(step, fetchJSON(`api/step?step=${step}`));
    return cache.steps.get(step).catch((error) => { cache.steps.delete(step); throw error; });
  }

  // The tokens of one sample: {chunk, begin, end} (rows begin … end − 1 of the chunk), or null.
  async function sampleRows(step, sample) {
    let chunk;
    if (SERVED) {
      const key = `${step}:${sample}`;
      if (!cache.chunks.has(key)) cache.chunks.set(key, fetchJSON(`api/sample?step=${step}&sample=${sample}`));
      chunk = await cache.chunks.get(key).catch((error) => { cache.chunks.delete(key); throw error; });
    } else {
      chunk = DATA.steps[String(step)].chunk;
    }
    const index = chunk.samples.indexOf(sample);
    if (index < 0) return null;
    return { chunk: chunk, index: index, begin: chunk.starts[index], end: chunk.starts[index + 1] };
  }

  function statistics(step) {
    if (!SERVED) {
      cache.statsValue.set(step, DATA.steps[String(step)].statistics);
      return Promise.resolve(DATA.steps[String(step)].statistics);
    }
    if (!cache.stats.has(step)) {
      cache.stats.set(step, fetchJSON(`api/stats?step=${step}`).then((value) => { cache.statsValue.set(step, value); return value; }));
    }
    return cache.stats.get(step).catch((error) => { cache.stats.delete(step); throw error; });
  }

  async function sameprompt(key) {
    if (!key) return [];
    if (!SERVED) {
      const found = [];
      for (const step of DATA.steps_in_file) {
        for (const s of DATA.steps[String(step)].overview.samples) {
          if (s.prompt === key) found.push({ step: step, sample: s.sample, score: s.score, uid: s.uid });
        }
      }
      return found;
    }
    if (!cache.prompts.has(key)) cache.prompts.set(key, fetchJSON(`api/prompt?key=${encodeURIComponent(key)}`));
    return cache.prompts.get(key).catch((error) => { cache.prompts.delete(key); throw error; });
  }

  // ------------------------------------------------------------------ quantities and colours

  function quantities(chunk) {
    const list = BASE_QUANTITIES.filter((q) => available(q, chunk));
    for (const label of Object.keys(chunk.estimates)) {
      list.push({ key: `est:${label}`, label: `${label}: raw advantage re-estimated`, kind: "estimate", name: label });
    }
    return list;
  }

  function available(q, chunk) {
    if (q.kind === "column") return q.name in chunk.columns;
    if (q.kind === "delta" || q.kind === "estimate") return q.name in chunk.estimates;
    if (q.kind === "difference") return q.name.every((name) => name in chunk.columns);
    if (q.kind === "update") return chunk.epochs.some((e) => q.name in e.columns);
    return false;
  }

  function epochRows(chunk, epoch) { return chunk.epochs.find((e) => e.epoch === epoch) || null; }

  function isNull(chunk, name, row) {
    const nulls = chunk.nulls[name];
    return nulls ? decode(nulls)[row] === 1 : false;
  }

  // The value of quantity q at chunk row `row` (null when it has none there); a code as its name.
  function valueOf(q, chunk, row, epoch) {
    if (q.kind === "column") return isNull(chunk, q.name, row) ? null : decode(chunk.columns[q.name])[row];
    if (q.kind === "difference") {
      const [a, b] = q.name;
      if (isNull(chunk, a, row) || isNull(chunk, b, row)) return null;
      return decode(chunk.columns[a])[row] - decode(chunk.columns[b])[row];
    }
    if (q.kind === "delta" || q.kind === "estimate") return decode(chunk.mask)[row] === 1 ? decode(chunk.estimates[q.name])[row] : null;
    const rows = epochRows(chunk, epoch);
    if (!rows || !(q.name in rows.columns) || decode(rows.trained)[row] !== 1) return null;
    const v = decode(rows.columns[q.name])[row];
    if (UPDATE_KIND[q.name] === "code") return CLIP_CODES[v] === undefined ? null : CLIP_CODES[v];
    return v;
  }

  function scaleKey(q, epoch) {
    if (q.kind === "update") return `e${epoch}:${q.name}`;
    if (q.kind === "delta" || q.kind === "estimate") return `est:${q.name}`;
    return q.key;
  }

  // Every number a token of `chunk` can have, in the order the details panel lists them: one entry
  // per column, derived quantity, re-estimate and (epoch, update column), each reading its value at a
  // row (null where the token has none). The token's data-q attribute and the details panel both
  // come from here. checks: "valid" (a null or non-finite value on a valid token makes the token
  // non-finite), "trained" (a non-finite value where trained does).
  function tokenFields(chunk) {
    const fields = [];
    const mask = decode(chunk.mask);
    for (const name of COLUMNS) {
      if (!(name in chunk.columns)) continue;
      const values = decode(chunk.columns[name]), nulls = chunk.nulls[name] ? decode(chunk.nulls[name]) : null;
      fields.push({ key: name, label: name, group: "column", checks: "valid", read: (row) => (nulls && nulls[row] === 1 ? null : values[row]) });
    }
    for (const q of BASE_QUANTITIES) {
      if (q.kind === "difference" && available(q, chunk)) {
        fields.push({ key: q.key, label: q.label, group: "column", read: (row) => valueOf(q, chunk, row) });
      } else if (q.kind === "delta" && available(q, chunk)) {
        const values = decode(chunk.estimates[q.name]);
        fields.push({ key: q.key, label: q.label, group: "column", read: (row) => (mask[row] === 1 ? values[row] : null) });
      }
    }
    for (const label of Object.keys(chunk.estimates)) {
      const values = decode(chunk.estimates[label]);
      fields.push({ key: `est.${label}`, label: label, group: "estimate", read: (row) => (mask[row] === 1 ? values[row] : null) });
    }
    for (const rows of chunk.epochs) {
      const trained = decode(rows.trained);
      for (const { name, kind } of UPDATE_COLUMNS) {
        if (!(name in rows.columns)) continue;
        const values = decode(rows.columns[name]);
        const field = { key: `e${rows.epoch}.${name}`, label: name, group: "epoch", epoch: rows.epoch, kind: kind,
          checks: kind === "code" ? null : "trained", read: (row) => (trained[row] === 1 ? values[row] : null) };
        if (kind === "code") field.text = (v) => (CLIP_CODES[v] === undefined ? "" : CLIP_CODES[v]);
        fields.push(field);
      }
    }
    return fields;
  }

  // A field's value as the details panel shows it.
  function display(field, v) {
    if (field.kind === "code") return field.text(v);
    if (field.kind === "flag") return v === 1 ? "yes" : "no";
    return fmt(v, 5);
  }

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

  // ------------------------------------------------------------------ rendering

  async function render() {
    const mine = ++renderCount;
    const stale = () => mine !== renderCount;
    const began = performance.now();
    $("error").hidden = true;
    try {
      await run();
      if (stale()) return;
      const state = readState();
      const steps = stepsShown();
      const step = steps.includes(state.step) ? state.step : defaultStep(steps);
      // served, with the response named: ask for it together with the step (the server reads the step once)
      if (SERVED && state.sample !== null) sampleRows(step, state.sample).catch(() => null);
      const info = await overview(step);
      if (stale()) return;
      const inFilter = info.samples.filter(FILTERS[state.filter]);
      const known = info.samples.some((s) => s.sample === state.sample);
      let sample = known ? state.sample : null;
      if (sample === null) {
        const start = !SERVED && DATA.start && DATA.start.step === step ? DATA.start.sample : null;
        const fallback = (inFilter[0] || info.samples[0] || {}).sample;
        sample = inFilter.some((s) => s.sample === start) ? start : fallback === undefined ? null : fallback;
      }
      const epochs = info.epochs;
      const epoch = epochs.includes(state.epoch) ? state.epoch : epochs.length ? epochs[epochs.length - 1] : null;
      const view = { step: step, sample: sample, info: info, epoch: epoch, state: state, inFilter: inFilter };
      renderHeader();
      renderStepControls(view);
      renderSampleList(view);
      renderCheck(view, null);
      renderSummary(view, null);
      const rows = sample === null ? null : await sampleRows(step, sample);
      if (stale()) return;
      if (rows) Object.assign(view, rows);
      view.stats = SERVED ? cache.statsValue.get(step) || null : DATA.steps[String(step)].statistics;  // known: coloured once
      const colouredWithStats = view.stats !== null;
      const fetched = performance.now();
      renderSample(view);
      checkGlyphs($("prompt").textContent + $("response").textContent).catch(() => null);  // a note only: never in the way
      // how long this view took: data (from the page, or the server) and drawing (benchmarks read it)
      document.body.dataset.timing = `${Math.round(fetched - began)} ${Math.round(performance.now() - fetched)}`;
      document.body.dataset.rendered = `${step}:${sample}`;
      document.body.dataset.colour = view.colourKey || "";
      const stats = await statistics(step);
      if (stale()) return;
      view.stats = stats;
      renderCheck(view, stats);
      renderSummary(view, stats);
      renderCompare(view, stats);
      if (rows && !colouredWithStats) colourTokens(view);  // the step's scales of the re-estimates
      document.body.dataset.stats = String(step);
      await renderAcross(view, stale);
    } catch (error) {
      if (stale()) return;
      showError(error);
    }
  }

  // ------------------------------------------------------------------ characters without a font

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

  function defaultStep(steps) {
    if (!SERVED && DATA.start && steps.includes(DATA.start.step)) return DATA.start.step;
    return steps[steps.length - 1];
  }

  function showError(error) {
    const box = $("error");
    box.textContent = String(error && error.message ? error.message : error);
    box.hidden = false;
    document.body.dataset.error = box.textContent;
  }

  function renderHeader() {
    $("title").textContent = `verl-ext view · ${RUN.path}`;
    const parts = [RUN.estimator, `${RUN.trainer} trainer`, `verl ${RUN.verl_version}`, `rollout ${RUN.rollout}`, `${RUN.steps.length} steps traced`];
    parts.push(RUN.tokenizer ? `tokenizer ${RUN.tokenizer}` : "no tokenizer: tokens shown as ids");
    $("run-line").textContent = parts.join(" · ");
    const notes = clear($("notes"));
    // what the data says about the run as a whole: it did not finish, steps missing or that do not read
    for (const note of RUN.notes || []) notes.appendChild(el("div", { class: "note", text: `note: ${note}` }));
    if (RUN.tokenizer_problem) notes.appendChild(el("div", { class: "note", text: `note: ${RUN.tokenizer_problem}` }));
    if (missingGlyphs) notes.appendChild(glyphNote());
    if (!SERVED) {
      const inFile = DATA.steps_in_file.length;
      if (inFile < RUN.steps.length) {
        notes.appendChild(el("div", { class: "note", text: `this file holds ${inFile} of the ${RUN.steps.length} traced steps (${DATA.steps_in_file.join(", ")}); verl-ext view ${RUN.path} serves them all` }));
      }
    }
  }

  function renderStepControls(view) {
    const steps = stepsShown();
    const select = clear($("step"));
    for (const step of steps) select.appendChild(el("option", { value: step, text: `${step}`, selected: step === view.step }));
    const at = steps.indexOf(view.step);
    $("step-prev").disabled = at <= 0;
    $("step-next").disabled = at >= steps.length - 1;
    const epochSelect = clear($("epoch"));
    for (const epoch of view.info.epochs) epochSelect.appendChild(el("option", { value: epoch, text: `${epoch}`, selected: epoch === view.epoch }));
    epochSelect.disabled = view.info.epochs.length === 0;
    if (!view.info.epochs.length) epochSelect.appendChild(el("option", { text: "no update tables" }));
    $("filter").value = view.state.filter;
    const sampleSelect = $("sample");
    if (sampleSelect.dataset.step !== String(view.step) || sampleSelect.options.length !== view.info.samples.length) {
      clear(sampleSelect);
      for (const s of view.info.samples) sampleSelect.appendChild(el("option", { value: s.sample, text: `${s.sample}` }));
      sampleSelect.dataset.step = String(view.step);
    }
    sampleSelect.value = String(view.sample);
    const position = view.inFilter.findIndex((s) => s.sample === view.sample);
    $("sample-prev").disabled = position <= 0 && !(position < 0 && view.inFilter.length);
    $("sample-next").disabled = position >= view.inFilter.length - 1;
  }

  function badges(s) {
    const out = [];
    if (s.wrong) out.push(el("span", { class: "badge wrong", title: "score below the step's best", text: "wrong" }));
    if (s.truncated) out.push(el("span", { class: "badge truncated", title: "cut at the length limit", text: "cut" }));
    if (s.clipped) out.push(el("span", { class: "badge clipped", title: "PPO clipped some of its tokens", text: "clip" }));
    if (s.nonfinite) out.push(el("span", { class: "badge nonfinite", title: "a value is NaN, infinite or missing", text: "NaN" }));
    if (s.tool_calls > 0) out.push(el("span", { class: "badge tool", title: `${s.tool_calls} tool call(s), ${s.turns} assistant turns`, text: "tool" }));
    return out;
  }

  function renderSampleList(view) {
    const list = $("sample-list");
    const chunk = !SERVED ? DATA.steps[String(view.step)].chunk : null;
    // Moving to another sample of the same list only moves the highlight (a step has hundreds).
    const key = JSON.stringify([view.step, view.state.filter, view.state.colour, view.epoch, view.info.samples.length]);
    if (key === listKey) {
      for (const a of list.querySelectorAll("a.current")) a.classList.remove("current");
      const here = list.querySelector(`a[data-sample="${view.sample}"]`);
      if (here) here.classList.add("current");
      return;
    }
    listKey = key;
    clear(list);
    for (const s of view.inFilter) {
      const absent = chunk && !chunk.samples.includes(s.sample);
      const a = link(`#${s.sample} · ${fmt(s.score, 2)} · ${s.valid} tok`, { step: view.step, sample: s.sample, token: null }, {
        class: (s.sample === view.sample ? "current" : "") + (absent ? " absent" : ""),
        "data-sample": s.sample,
        title: absent ? "not in this file (cut to fit its size)" : `uid ${s.uid}`,
      });
      for (const badge of badges(s)) a.appendChild(badge);
      list.appendChild(el("li", {}, a));
    }
    const total = view.info.samples.length;
    let head = view.state.filter === "all" ? `${total} responses` : `${view.inFilter.length} of ${total} responses`;
    if (chunk && chunk.samples.length < total) head += ` (${chunk.samples.length} in this file)`;
    $("samples-head").textContent = head;
  }

  function renderSummary(view, stats) {
    const box = clear($("step-summary"));
    box.appendChild(el("b", { text: `step ${view.step}` }));
    box.appendChild(document.createTextNode(" "));
    const summary = stats && stats.summary;
    const items = [];  // [key, label, value, decimals]
    if (summary) for (const f of SUMMARY_FIELDS) items.push([f.key, f.label, summary[f.key], f.digits]);
    else items.push(["tokens", "tokens", view.info.valid, 0]);  // the step's valid tokens, until the summary comes
    const whiten = (stats && stats.whiten) || view.info.whiten;
    if (whiten) items.push(["whiten_mean", "whitening μ", whiten.mean, 4], ["whiten_sigma", "σ", whiten.sigma, 4]);
    for (const [key, label, value, digits] of items) {
      if (value === null || value === undefined) continue;
      const span = el("span", { class: "stat", "data-key": key, "data-value": value });
      span.appendChild(document.createTextNode(`${label} `));
      span.appendChild(el("b", { text: fmt(value, digits) }));
      box.appendChild(span);
    }
    if (!stats) box.appendChild(el("span", { class: "muted", text: "computing the step's statistics…" }));
  }

  function renderCheck(view, stats) {
    const box = clear($("check"));
    box.className = "panel";
    let failures, notChecked, scope;
    if (!SERVED) {
      failures = DATA.check.failures;
      notChecked = DATA.check.not_checked || [];
      scope = DATA.check.steps.length === 1 ? `step ${DATA.check.steps[0]}` : `the ${DATA.check.steps.length} steps in this file`;
    } else if (stats && stats.check) {
      failures = stats.check;
      notChecked = stats.not_checked || [];
      scope = `step ${view.step}`;
    } else {
      return;
    }
    box.classList.add(failures.length ? "fail" : notChecked.length ? "incomplete" : "pass");
    if (!failures.length) {
      if (notChecked.length) appendNotChecked(box, notChecked, scope);
      else box.appendChild(el("span", { text: `verl-ext check: every identity of docs/definitions.md §8 holds on ${scope}` }));
      return;
    }
    box.appendChild(el("b", { text: `verl-ext check: ${failures.length} failed (identity, step) on ${scope}` }));
    const list = el("ul", { id: "failures" });
    for (const f of failures) {
      const where = { step: f.step, sample: f.sample, token: f.token };
      const item = el("li", { "data-identity": f.identity, "data-step": f.step, "data-sample": f.sample, "data-token": f.token });
      item.appendChild(el("b", { text: f.identity }));
      item.appendChild(document.createTextNode(` (${f.title}): `));
      const inView = stepsShown().includes(f.step) && f.sample !== null;
      item.appendChild(inView ? link(f.text, where, { class: "failure" }) : el("span", { text: f.text }));
      if (f.violations > 1) item.appendChild(document.createTextNode(` — ${f.violations} tokens in all`));
      list.appendChild(item);
    }
    box.appendChild(list);
    if (notChecked.length) appendNotChecked(box, notChecked, scope);
  }

  // Identities that apply to the run but could not be evaluated here (the run's estimator does not
  // import where the page was made): the check is incomplete, which the panel never shows as holding.
  function appendNotChecked(box, notChecked, scope) {
    const count = notChecked.reduce((n, reason) => n + reason.identities.length, 0);
    box.appendChild(el("b", { text: `verl-ext check: incomplete, ${count} ${count === 1 ? "identity" : "identities"} not checked on ${scope}` }));
    const list = el("ul", { id: "not-checked" });
    for (const reason of notChecked) {
      const names = reason.identities.map((i) => i.identity);
      const item = el("li", { "data-identities": names.join(",") });
      item.appendChild(el("b", { text: names.join(", ") }));
      item.appendChild(document.createTextNode(`: ${reason.reason}`));
      list.appendChild(item);
    }
    box.appendChild(list);
  }

  function renderSample(view) {
    current = view;  // hovering needs the view the tokens were drawn from (its fields)
    const head = clear($("sample-head"));
    const response = clear($("response"));
    const prompt = clear($("prompt"));
    clear($("group"));
    clear($("across"));
    clear($("legend"));
    if (view.sample === null) { head.textContent = "this step has no responses"; return; }
    const meta = view.info.samples.find((s) => s.sample === view.sample);
    head.appendChild(el("b", { text: `step ${view.step} · sample ${view.sample}` }));
    head.appendChild(document.createTextNode(` · uid ${meta.uid} · ${meta.rows} tokens (${meta.valid} valid) · score ${fmt(meta.score, 3)} · ${meta.truncated ? "truncated at the length limit" : meta.eos ? "ended with EOS" : "no EOS"}`));
    for (const badge of badges(meta)) head.appendChild(badge);
    if (!view.chunk) {
      response.appendChild(el("span", { class: "muted", text: "this response is not in this file (its step was cut to fit the page's size); verl-ext view TRACE serves every response" }));
      return;
    }
    const chunk = view.chunk;
    const prompt_text = chunk.prompts[view.index];
    prompt.textContent = prompt_text === null ? "(no prompt recorded)" : prompt_text;
    const qs = quantities(chunk);
    const colourSelect = clear($("colour"));
    let q = qs.find((x) => x.key === view.state.colour) || qs.find((x) => x.key === BASE_QUANTITIES[0].key) || qs[0];
    for (const x of qs) colourSelect.appendChild(el("option", { value: x.key, text: x.label, selected: q && x.key === q.key }));
    view.q = q;
    view.colourKey = q ? q.key : null;
    const mask = decode(chunk.mask), ids = decode(chunk.token_id), positions = decode(chunk.token_index);
    const turns = decode(chunk.turn), roles = decode(chunk.role);
    // Every number of a token also goes into one attribute, data-q="score=0 reward=-0.01 … e1.ratio=1.02"
    // (for scripts and tests: one attribute per token instead of dozens keeps drawing fast).
    const fields = view.fields = tokenFields(chunk);
    const idNull = chunk.nulls.token_id ? decode(chunk.nulls.token_id) : null;
    // a cut response's last valid token, where the policy would have gone on (docs/definitions.md#truncated-responses)
    let cutEnd = -1;
    if (meta.truncated) for (let row = view.begin; row < view.end; row++) if (mask[row] === 1) cutEnd = row;
    const fragment = document.createDocumentFragment();
    for (let row = view.begin; row < view.end; row++) {
      const span = document.createElement("span");
      const valid = mask[row] === 1;
      span.className = valid ? "tok" : "tok masked";
      span.textContent = chunk.pieces[row];
      span.setAttribute("data-t", positions[row]);
      if (!(idNull && idNull[row] === 1)) span.setAttribute("data-id", ids[row]);
      span.setAttribute("data-mask", valid ? "1" : "0");
      span.setAttribute("data-turn", turns[row]);
      if (roles[row] !== NO_CODE) span.setAttribute("data-role", chunk.role_names[roles[row]]);
      if (!valid && roles[row] !== NO_CODE) span.classList.add(`role-${chunk.role_names[roles[row]]}`);
      // the first token the policy wrote after a hole opens an assistant turn
      if (valid && row > view.begin && turns[row] !== turns[row - 1]) span.classList.add("turn-start");
      span._row = row;
      const parts = [];
      let bad = false;
      for (const f of fields) {
        const v = f.read(row);
        if (v === null) { if (f.checks === "valid" && valid) bad = true; continue; }
        parts.push(`${f.key}=${f.text ? f.text(v) : v}`);
        if ((f.checks === "trained" || (f.checks === "valid" && valid)) && !Number.isFinite(v)) bad = true;
      }
      span.setAttribute("data-q", parts.join(" "));
      if (bad) span.classList.add("nonfinite");
      if (view.state.token !== null && positions[row] === view.state.token) span.classList.add("focus");
      if (row === cutEnd) markCutEnd(span, meta);
      fragment.appendChild(span);
    }
    response.appendChild(fragment);
    view.spans = response.children;
    colourTokens(view);
    renderGroup(view, meta);
    const focus = response.querySelector(".tok.focus");
    pinned = focus;
    showDetails(focus, view);
    if (focus) focus.scrollIntoView({ block: "nearest" });
  }

  // The marker and its tooltip; V(s_L) is the critic's value of the state after the token, recorded
  // only by a run with algorithm.truncation=bootstrap (the prompt table's bootstrap_value).
  function cutEndText(meta) {
    const value = meta.bootstrap_value;
    return "cut at the length limit after this token: the response did not end. " + (value === null || value === undefined
      ? "V(s_L) not recorded (the run did not bootstrap)"
      : `V(s_L) = ${fmt(value, 4)}, the critic's value after it (bootstrap adds γ·V(s_L) to this token's reward)`);
  }

  function markCutEnd(span, meta) {
    span.classList.add("cut-end");
    span.title = cutEndText(meta);
    if (meta.bootstrap_value !== null && meta.bootstrap_value !== undefined) span.setAttribute("data-bootstrap-value", meta.bootstrap_value);
  }

  function colourTokens(view) {
    const q = view.q;
    const response = $("response");
    response.setAttribute("data-colour", q ? q.key : "");
    const legend = clear($("legend"));
    if (!q) return;
    const spans = [...view.spans];
    const mask = decode(view.chunk.mask);
    const values = spans.map((span, i) => (mask[view.begin + i] === 1 ? valueOf(q, view.chunk, view.begin + i, view.epoch) : null));
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

  function renderGroup(view, meta) {
    const box = clear($("group"));
    if (meta.uid === null) return;
    const group = view.info.samples.filter((s) => s.uid === meta.uid);
    box.appendChild(el("b", { text: `its group (uid ${meta.uid}, ${group.length} responses): ` }));
    for (const s of group) {
      const a = link(`#${s.sample} (${fmt(s.score, 2)})`, { sample: s.sample, token: null }, { class: s.sample === view.sample ? "current" : "", "data-sample": s.sample });
      box.appendChild(a);
    }
  }

  async function renderAcross(view, stale) {
    const meta = view.info.samples.find((s) => s.sample === view.sample);
    const found = meta && meta.prompt ? (await sameprompt(meta.prompt)).filter((x) => x.step !== view.step) : null;
    if (stale()) return;
    const box = clear($("across"));
    if (found === null) return;
    const byStep = new Map();
    for (const x of found) { if (!byStep.has(x.step)) byStep.set(x.step, []); byStep.get(x.step).push(x); }
    box.appendChild(el("b", { text: byStep.size ? `the same prompt at ${byStep.size} other step(s): ` : "the same prompt at no other step" + (SERVED ? "" : " in this file") }));
    for (const [step, xs] of byStep) {
      const span = el("span", { "data-step": step }, `step ${step}: `);
      for (const x of xs) {
        span.appendChild(link(`#${x.sample}${x.score === undefined || x.score === null ? "" : ` (${fmt(x.score, 2)})`}`, { step: step, sample: x.sample, token: null }, { "data-sample": x.sample }));
      }
      box.appendChild(span);
    }
  }

  function renderCompare(view, stats) {
    const box = clear($("compare"));
    if (!stats || !stats.comparison) {
      if (stats && stats.comparison_notes.length) box.appendChild(el("div", { class: "muted", text: stats.comparison_notes.join("; ") }));
      return;
    }
    box.appendChild(el("b", { text: `the estimators on step ${view.step}, re-estimated from its rewards and values (raw advantages, before whitening; colour by one: click its name)` }));
    const table = el("table", { id: "compare-table" });
    const head = el("tr", {});
    const columns = stats.comparison_columns;  // [{key, label}]: the comparison's statistics, in its order
    head.appendChild(el("th", { text: "estimator" }));
    for (const { label } of columns) head.appendChild(el("th", { class: "num", text: label }));  // over its right-aligned numbers
    table.appendChild(head);
    for (const row of stats.comparison) {
      const tr = el("tr", { "data-estimator": row.estimator });
      const key = `est:${row.estimator}`;
      tr.appendChild(el("td", {}, link(row.estimator, { colour: key }, { class: view.colourKey === key ? "current" : "" })));
      for (const { key } of columns) tr.appendChild(el("td", { class: "num", "data-key": key, "data-value": row[key], text: fmt(row[key]) }));
      table.appendChild(tr);
    }
    box.appendChild(table);
    for (const note of stats.comparison_notes) box.appendChild(el("div", { class: "muted", text: `note: ${note}` }));
  }

  // ------------------------------------------------------------------ the details of one token

  // The details of a token span: its numbers read from the data at its row (the fields it was drawn with).
  function showDetails(span, view) {
    view = view || current;
    const box = clear($("details"));
    if (!span || !view || !view.fields) {
      box.appendChild(el("div", { class: "muted", text: "hover a token for every number of it; click to pin it" }));
      return;
    }
    const row = span._row;
    const values = view.fields.map((f) => [f, f.read(row)]).filter(([, v]) => v !== null);
    const id = span.getAttribute("data-id");
    const role = span.getAttribute("data-role");
    const written = span.getAttribute("data-mask") === "1" ? "" : ` · masked (not trained)${role ? `, written by: ${role}` : ""}`;
    box.appendChild(el("div", {}, el("span", { class: "piece", text: span.textContent }), ` t = ${span.getAttribute("data-t")} · id ${id === null ? "—" : id} · turn ${span.getAttribute("data-turn")}${written}`));
    const table = (rows, attrs) => {
      const t = el("table", attrs || {});
      for (const [f, v] of rows) t.appendChild(el("tr", {}, el("td", { text: f.label }), el("td", { class: "num", text: display(f, v) })));
      return t;
    };
    box.appendChild(table(values.filter(([f]) => f.group === "column")));
    if (span.classList.contains("cut-end")) {
      const meta = view.info.samples.find((s) => s.sample === view.sample);
      box.appendChild(el("div", { class: "cut-note", text: cutEndText(meta) }));
    }
    const estimates = values.filter(([f]) => f.group === "estimate");
    if (estimates.length) {
      box.appendChild(el("h3", { text: "raw advantage, re-estimated" }));
      box.appendChild(table(estimates));
    }
    const epochs = [...new Set(values.filter(([f]) => f.group === "epoch").map(([f]) => f.epoch))].sort((a, b) => a - b);
    for (const epoch of epochs) {
      box.appendChild(el("h3", { text: `PPO epoch ${epoch}` }));
      box.appendChild(table(values.filter(([f]) => f.group === "epoch" && f.epoch === epoch), { "data-epoch": epoch }));
    }
    if (span.getAttribute("data-mask") === "1" && !epochs.length && view.info.epochs.length) {
      box.appendChild(el("div", { class: "muted", text: "not in the update tables" }));
    }
  }

  // ------------------------------------------------------------------ events

  function wire() {
    window.addEventListener("hashchange", render);
    $("step").addEventListener("change", (e) => go({ step: Number(e.target.value), token: null }));
    $("sample").addEventListener("change", (e) => go({ sample: Number(e.target.value), token: null }));
    $("colour").addEventListener("change", (e) => go({ colour: e.target.value }));
    $("epoch").addEventListener("change", (e) => go({ epoch: Number(e.target.value) }));
    $("filter").addEventListener("change", (e) => go({ filter: e.target.value }));
    $("step-prev").addEventListener("click", () => moveStep(-1));
    $("step-next").addEventListener("click", () => moveStep(1));
    $("sample-prev").addEventListener("click", () => moveSample(-1));
    $("sample-next").addEventListener("click", () => moveSample(1));
    const response = $("response");
    response.addEventListener("mouseover", (e) => {
      const span = e.target.closest(".tok");
      if (span) showDetails(span);
    });
    response.addEventListener("mouseleave", () => showDetails(pinned));
    response.addEventListener("click", (e) => {
      const span = e.target.closest(".tok");
      if (span) go({ token: Number(span.getAttribute("data-t")) });
    });
    document.addEventListener("keydown", (e) => {
      if (e.target && (e.target.tagName === "SELECT" || e.target.tagName === "INPUT")) return;
      if (e.key === "ArrowLeft") (e.shiftKey ? moveStep : moveSample)(-1);
      else if (e.key === "ArrowRight") (e.shiftKey ? moveStep : moveSample)(1);
    });
  }

  async function moveStep(delta) {
    const steps = stepsShown();
    const state = readState();
    const at = steps.indexOf(steps.includes(state.step) ? state.step : defaultStep(steps));
    const next = steps[at + delta];
    if (next !== undefined) go({ step: next, token: null });
  }

  async function moveSample(delta) {
    const state = readState();
    const steps = stepsShown();
    const step = steps.includes(state.step) ? state.step : defaultStep(steps);
    const info = await overview(step);
    const list = info.samples.filter(FILTERS[state.filter]);
    const shown = Number((document.body.dataset.rendered || "").split(":")[1]);
    let at = list.findIndex((s) => s.sample === shown);
    if (at < 0) at = delta > 0 ? -1 : list.length;
    const next = list[at + delta];
    if (next) go({ step: step, sample: next.sample, token: null });
  }

  colourRules();
  wire();
  render();
})();
