// verl-ext view: the data, from the page itself (a file) or from its server (served: asked for one step
// and one response at a time, each answer kept), its arrays decoded, and the value of every quantity at
// a token. Nothing here touches the page's elements.
(function (viewer) {
  "use strict";

  const { DATA, SERVED, CLIP_CODES, COLUMNS, UPDATE_COLUMNS, UPDATE_KIND, BASE_QUANTITIES } = viewer;
  const cache = { steps: new Map(), chunks: new Map(), stats: new Map(), statsValue: new Map(), prompts: new Map() };
  const decoded = new WeakMap();  // an encoded array -> its typed array
  let RUN = DATA.run || null;  // served: the server puts the run in the page too (/api/run again lists new steps)

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

  // ------------------------------------------------------------------ inline, or from the server

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

  function defaultStep(steps) {
    if (!SERVED && DATA.start && steps.includes(DATA.start.step)) return DATA.start.step;
    return steps[steps.length - 1];
  }

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

  // A file's tokens of a step (the samples it kept); null when served, where every sample can be asked for.
  function fileChunk(step) { return SERVED ? null : DATA.steps[String(step)].chunk; }

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

  // The step's statistics if they are here already (a file has them all), else null: the tokens are
  // then coloured once more when they come.
  function knownStatistics(step) { return SERVED ? cache.statsValue.get(step) || null : DATA.steps[String(step)].statistics; }

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

  // ------------------------------------------------------------------ quantities

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
    for (const name of Object.keys(chunk.columns)) {  // a response's policy version and staleness on its tokens (asynchronous runs)
      if (COLUMNS.includes(name)) continue;
      const values = decode(chunk.columns[name]), nulls = chunk.nulls[name] ? decode(chunk.nulls[name]) : null;
      fields.push({ key: name, label: name, group: "column", read: (row) => (nulls && nulls[row] === 1 ? null : values[row]) });
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

  Object.assign(viewer, {
    decode: decode, run: run, stepsShown: stepsShown, defaultStep: defaultStep, overview: overview, sampleRows: sampleRows,
    fileChunk: fileChunk, statistics: statistics, knownStatistics: knownStatistics, sameprompt: sameprompt,
    quantities: quantities, valueOf: valueOf, scaleKey: scaleKey, tokenFields: tokenFields,
  });
})(window.verlExtViewer);
