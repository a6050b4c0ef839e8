// verl-ext view: the page's script (no dependencies, no network beyond its own server in served mode).
// Every string from the trace (tokens, prompts, paths, uids) is shown with textContent, never as markup.
// State lives in the URL's hash (#step=5&sample=3&colour=value&epoch=0&filter=wrong&token=4), so a link
// shows the same thing and the browser's back button works.
(function () {
  "use strict";

  const DATA = JSON.parse(document.getElementById("verl-ext-data").textContent);
  const SERVED = DATA.mode === "served";
  const CLIP_CODES = DATA.clip_codes;  // verl_ext.trace.schema.CLIP_CODES: the payload's clip values index it
  const CLIP_COLOURS = { none: "#ffffff", low: "#4575b4", high: "#d73027", dual: "#7b3294" };
  const FILTERS = {
    all: () => true,
    wrong: (s) => s.wrong,
    truncated: (s) => s.truncated,
    clipped: (s) => s.clipped,
    nonfinite: (s) => s.nonfinite,
  };
  const COLUMNS = DATA.float_columns;  // verl_ext.trace.schema's float columns: the details panel lists them
  const UPDATE_COLUMNS = ["minibatch", "log_prob", "ratio", "clip", "pg_loss", "entropy", "is_weight",
    "vpred", "vpred_clipped", "vf_loss", "vf_clipped"];
  // What a token can be coloured by. kind: column (token table), delta (td0's re-estimate), update
  // (the chosen PPO epoch's row), gap (rollout − trainer log-prob), estimate (re-estimated raw advantage).
  const BASE_QUANTITIES = [
    { key: "advantage", label: "advantage (whitened, as trained)", kind: "column", name: "advantage" },
    { key: "advantage_raw", label: "advantage, raw (before whitening)", kind: "column", name: "advantage_raw" },
    { key: "value", label: "value V(s_t)", kind: "column", name: "value" },
    { key: "return", label: "return (critic target)", kind: "column", name: "return" },
    { key: "reward", label: "reward r_t", kind: "column", name: "reward" },
    { key: "score", label: "score s_t", kind: "column", name: "score" },
    { key: "kl", label: "KL kld_t", kind: "column", name: "kl" },
    { key: "delta", label: "δ_t = r_t + γV_{t+1} − V_t", kind: "delta", name: "td0" },
    { key: "entropy", label: "entropy (epoch)", kind: "update", name: "entropy" },
    { key: "ratio", label: "ratio π_θ/π_old (epoch)", kind: "update", name: "ratio", centre: 1 },
    { key: "clip", label: "clip region (epoch)", kind: "update", name: "clip", categorical: true },
    { key: "pg_loss", label: "policy-loss term (epoch)", kind: "update", name: "pg_loss" },
    { key: "vf_loss", label: "value-loss term (epoch)", kind: "update", name: "vf_loss" },
    { key: "gap", label: "rollout − trainer log-prob", kind: "gap", name: "gap" },
  ];

  const cache = { steps: new Map(), chunks: new Map(), stats: new Map(), statsValue: new Map(), prompts: new Map() };
  let RUN = DATA.run || null;  // served: the server puts the run in the page too (/api/run again lists new steps)
  let renderCount = 0;
  let pinned = null;

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

  const decoded = new WeakMap();
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
      colour: params.get("colour") || "advantage", filter: FILTERS[params.get("filter")] ? params.get("filter") : "all",
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

  function quantities(view) {
    const list = BASE_QUANTITIES.filter((q) => available(q, view));
    for (const label of Object.keys(view.chunk.estimates)) {
      list.push({ key: `est:${label}`, label: `${label}: raw advantage re-estimated`, kind: "estimate", name: label });
    }
    return list;
  }

  function available(q, view) {
    const chunk = view.chunk;
    if (q.kind === "column") return q.name in chunk.columns;
    if (q.kind === "delta") return "td0" in chunk.estimates;
    if (q.kind === "gap") return "rollout_log_prob" in chunk.columns && "old_log_prob" in chunk.columns;
    if (q.kind === "update") return chunk.epochs.some((e) => q.name in e.columns);
    return true;
  }

  function epochRows(view, epoch) { return view.chunk.epochs.find((e) => e.epoch === epoch) || null; }

  function isNull(chunk, name, row) {
    const nulls = chunk.nulls[name];
    return nulls ? decode(nulls)[row] === 1 : false;
  }

  // The value of quantity q at chunk row `row` (null when it has none there).
  function valueOf(q, view, row, epoch) {
    const chunk = view.chunk;
    const valid = decode(chunk.mask)[row] === 1;
    if (q.kind === "column") return isNull(chunk, q.name, row) ? null : decode(chunk.columns[q.name])[row];
    if (q.kind === "gap") {
      if (isNull(chunk, "rollout_log_prob", row) || isNull(chunk, "old_log_prob", row)) return null;
      return decode(chunk.columns.rollout_log_prob)[row] - decode(chunk.columns.old_log_prob)[row];
    }
    if (q.kind === "delta" || q.kind === "estimate") return valid ? decode(chunk.estimates[q.name])[row] : null;
    const rows = epochRows(view, epoch);
    if (!rows || !(q.name in rows.columns) || decode(rows.trained)[row] !== 1) return null;
    const v = decode(rows.columns[q.name])[row];
    if (q.name === "clip") return CLIP_CODES[v] === undefined ? null : CLIP_CODES[v];
    return v;
  }

  function scaleKey(q, epoch) {
    if (q.kind === "update") return `e${epoch}:${q.name}`;
    if (q.kind === "delta") return "est:td0";
    if (q.kind === "estimate") return `est:${q.name}`;
    return q.key;
  }

  // Token colours are classes (a style attribute on each of thousands of tokens is slow to apply):
  // c-20 … c20 for (x − centre)/scale rounded to twentieths, clip-<code>, c-inf; their rules are made
  // here, into the page's own style sheet, from the same function the legend uses.
  const STEPS = 20;
  function colourRules() {
    const sheet = document.querySelector("style").sheet;
    for (let k = -STEPS; k <= STEPS; k++) {
      sheet.insertRule(`.tok.c${k} { background-color: ${diverging(k / STEPS)};${Math.abs(k / STEPS) > 0.65 ? " color: #fff;" : ""} }`, sheet.cssRules.length);
    }
    for (const code of CLIP_CODES) {
      sheet.insertRule(`.tok.clip-${code} { background-color: ${CLIP_COLOURS[code]};${code === "none" ? "" : " color: #fff;"} }`, sheet.cssRules.length);
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
    const parts = [RUN.estimator, `${RUN.trainer} trainer`, `verl ${RUN.verl_version}`, `${RUN.steps.length} steps traced`];
    parts.push(RUN.tokenizer ? `tokenizer ${RUN.tokenizer}` : "no tokenizer: tokens shown as ids");
    $("run-line").textContent = parts.join(" · ");
    const notes = clear($("notes"));
    if (RUN.tokenizer_problem) notes.appendChild(el("div", { class: "note", text: `note: ${RUN.tokenizer_problem}` }));
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
    return out;
  }

  let listKey = null;
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
    const items = [];
    if (summary) {
      items.push(["samples", summary.samples, 0], ["tokens", summary.tokens, 0], ["score", summary.score, 3],
        ["explained_var", summary.explained_var, 3], ["ev_mc", summary.ev_mc, 3], ["ev_mc_last", summary.ev_mc_last, 3],
        ["kl", summary.kl, 4], ["clip_low", summary.clip_low, 4], ["clip_high", summary.clip_high, 4],
        ["clip_dual", summary.clip_dual, 4], ["adv_dlogp_corr", summary.adv_dlogp_corr, 3]);
    } else {
      items.push(["tokens", view.info.valid, 0]);
    }
    const whiten = view.info.whiten;
    if (whiten) items.push(["whiten_mean", whiten.mean, 4], ["whiten_sigma", whiten.sigma, 4]);
    else if (summary) items.push(["whiten_mean", summary.adv_raw_mean, 4], ["whiten_sigma", summary.adv_raw_std, 4]);
    const names = { explained_var: "explained var", ev_mc: "EV vs MC return", ev_mc_last: "EV at last token", whiten_mean: "whitening μ", whiten_sigma: "σ", adv_dlogp_corr: "corr(A, Δlog π)", clip_low: "clip low", clip_high: "clip high", clip_dual: "clip dual" };
    for (const [key, value, digits] of items) {
      if (value === null || value === undefined) continue;
      const span = el("span", { class: "stat", "data-key": key, "data-value": value });
      span.appendChild(document.createTextNode(`${names[key] || key} `));
      span.appendChild(el("b", { text: fmt(value, digits) }));
      box.appendChild(span);
    }
    if (!stats) box.appendChild(el("span", { class: "muted", text: "computing the step's statistics…" }));
  }

  function renderCheck(view, stats) {
    const box = clear($("check"));
    box.className = "panel";
    let failures, scope;
    if (!SERVED) {
      failures = DATA.check.failures;
      scope = DATA.check.steps.length === 1 ? `step ${DATA.check.steps[0]}` : `the ${DATA.check.steps.length} steps in this file`;
    } else if (stats && stats.check) {
      failures = stats.check;
      scope = `step ${view.step}`;
    } else {
      return;
    }
    box.classList.add(failures.length ? "fail" : "pass");
    if (!failures.length) {
      box.appendChild(el("span", { text: `verl-ext check: every identity of docs/definitions.md §8 holds on ${scope}` }));
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
  }

  function renderSample(view) {
    current = view;  // hovering needs the view the tokens were drawn from
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
    const qs = quantities(view);
    const colourSelect = clear($("colour"));
    let q = qs.find((x) => x.key === view.state.colour) || qs.find((x) => x.key === "advantage") || qs[0];
    for (const x of qs) colourSelect.appendChild(el("option", { value: x.key, text: x.label, selected: q && x.key === q.key }));
    view.q = q;
    view.colourKey = q ? q.key : null;
    const mask = decode(chunk.mask), ids = decode(chunk.token_id), positions = decode(chunk.token_index);
    // Every number of a token goes into one attribute, data-q="score=0 reward=-0.01 … e1.ratio=1.02":
    // one attribute per token instead of dozens keeps a response of thousands of tokens fast to draw.
    const columns = Object.keys(chunk.columns).map((name) => [name, decode(chunk.columns[name]), chunk.nulls[name] ? decode(chunk.nulls[name]) : null]);
    const idNull = chunk.nulls.token_id ? decode(chunk.nulls.token_id) : null;
    const estimates = Object.keys(chunk.estimates).map((label) => [`est.${label}`, decode(chunk.estimates[label])]);
    const td0 = "td0" in chunk.estimates ? decode(chunk.estimates.td0) : null;
    const gapOf = "rollout_log_prob" in chunk.columns && "old_log_prob" in chunk.columns;
    const epochs = chunk.epochs.map((rows) => [rows.epoch, decode(rows.trained),
      Object.keys(rows.columns).map((name) => [`e${rows.epoch}.${name}`, name, decode(rows.columns[name])])]);
    const fragment = document.createDocumentFragment();
    for (let row = view.begin; row < view.end; row++) {
      const span = document.createElement("span");
      const valid = mask[row] === 1;
      span.className = valid ? "tok" : "tok masked";
      span.textContent = chunk.pieces[row];
      span.setAttribute("data-t", positions[row]);
      if (!(idNull && idNull[row] === 1)) span.setAttribute("data-id", ids[row]);
      span.setAttribute("data-mask", valid ? "1" : "0");
      const parts = [];
      let bad = false;
      for (const [name, values, nulls] of columns) {
        if (nulls && nulls[row] === 1) { if (valid) bad = true; continue; }
        const v = values[row];
        parts.push(`${name}=${v}`);
        if (valid && !Number.isFinite(v)) bad = true;
      }
      if (gapOf) {
        const gap = valueOf({ kind: "gap" }, view, row);
        if (gap !== null) parts.push(`gap=${gap}`);
      }
      if (valid) {
        if (td0) parts.push(`delta=${td0[row]}`);
        for (const [key, values] of estimates) parts.push(`${key}=${values[row]}`);
      }
      for (const [, trained, names] of epochs) {
        if (trained[row] !== 1) continue;
        for (const [key, name, values] of names) {
          let v = values[row];
          if (name === "clip") v = CLIP_CODES[v] === undefined ? "" : CLIP_CODES[v];
          else if (!Number.isFinite(v)) bad = true;
          parts.push(`${key}=${v}`);
        }
      }
      span.setAttribute("data-q", parts.join(" "));
      if (bad) span.classList.add("nonfinite");
      if (view.state.token !== null && positions[row] === view.state.token) span.classList.add("focus");
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

  function colourTokens(view) {
    const q = view.q;
    const response = $("response");
    response.setAttribute("data-colour", q ? q.key : "");
    const legend = clear($("legend"));
    if (!q) return;
    const spans = [...view.spans];
    const mask = decode(view.chunk.mask);
    const values = spans.map((span, i) => (mask[view.begin + i] === 1 ? valueOf(q, view, view.begin + i, view.epoch) : null));
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
    for (const name of ["estimator", "Var over the step", "Var within a prompt's group", "mean |A|"]) head.appendChild(el("th", { text: name }));
    table.appendChild(head);
    for (const row of stats.comparison) {
      const tr = el("tr", { "data-estimator": row.estimator });
      const key = `est:${row.estimator}`;
      tr.appendChild(el("td", {}, link(row.estimator, { colour: key }, { class: view.colourKey === key ? "current" : "" })));
      for (const name of ["var_batch", "var_within_group", "mean_abs"]) tr.appendChild(el("td", { class: "num", "data-value": row[name], text: fmt(row[name]) }));
      table.appendChild(tr);
    }
    box.appendChild(table);
    for (const note of stats.comparison_notes) box.appendChild(el("div", { class: "muted", text: `note: ${note}` }));
  }

  // ------------------------------------------------------------------ the details of one token

  // The numbers of a token span: data-q="name=value name=value …" as a Map (values as written).
  function numbersOf(span) {
    const map = new Map();
    for (const part of (span.getAttribute("data-q") || "").split(" ")) {
      const at = part.indexOf("=");
      if (at > 0) map.set(part.slice(0, at), part.slice(at + 1));
    }
    return map;
  }

  let current = null;

  function showDetails(span, view) {
    view = view || current;
    const box = clear($("details"));
    if (!span) {
      box.appendChild(el("div", { class: "muted", text: "hover a token for every number of it; click to pin it" }));
      return;
    }
    const q = numbersOf(span);
    const num = (key) => (q.has(key) ? Number(q.get(key)) : null);
    const id = span.getAttribute("data-id");
    box.appendChild(el("div", {}, el("span", { class: "piece", text: span.textContent }), ` t = ${span.getAttribute("data-t")} · id ${id === null ? "—" : id}${span.getAttribute("data-mask") === "1" ? "" : " · masked (not trained)"}`));
    const table = el("table", {});
    const row = (label, value, title) => table.appendChild(el("tr", { title: title || null }, el("td", { text: label }), el("td", { class: "num", text: value })));
    for (const name of COLUMNS) if (q.has(name)) row(name, fmt(num(name), 5));
    if (q.has("gap")) row("rollout − old log-prob", fmt(num("gap"), 5), "train/inference mismatch");
    if (q.has("delta")) row("δ_t", fmt(num("delta"), 5), "r_t + γV_{t+1} − V_t");
    box.appendChild(table);
    const estimates = [...q.keys()].filter((key) => key.startsWith("est."));
    if (estimates.length) {
      box.appendChild(el("h3", { text: "raw advantage, re-estimated" }));
      const t2 = el("table", {});
      for (const key of estimates) t2.appendChild(el("tr", {}, el("td", { text: key.slice(4) }), el("td", { class: "num", text: fmt(num(key), 5) })));
      box.appendChild(t2);
    }
    const epochs = new Set([...q.keys()].map((key) => /^e(\d+)\./.exec(key)).filter(Boolean).map((m) => Number(m[1])));
    for (const epoch of [...epochs].sort((a, b) => a - b)) {
      box.appendChild(el("h3", { text: `PPO epoch ${epoch}` }));
      const t3 = el("table", { "data-epoch": epoch });
      for (const name of UPDATE_COLUMNS) {
        const key = `e${epoch}.${name}`;
        if (!q.has(key)) continue;
        const raw = q.get(key);
        t3.appendChild(el("tr", {}, el("td", { text: name }), el("td", { class: "num", text: name === "clip" ? raw : name === "vf_clipped" ? (raw === "1" ? "yes" : "no") : fmt(Number(raw), 5) })));
      }
      box.appendChild(t3);
    }
    if (span.getAttribute("data-mask") === "1" && !epochs.size && view && view.info.epochs.length) {
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
