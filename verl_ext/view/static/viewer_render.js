// verl-ext view: the page's panels drawn from the data (the run, the step's controls and responses, its
// check, summary and estimators, one response token by token, the details of a token). What to draw
// comes from viewer.js's render.
(function (viewer) {
  "use strict";

  const { DATA, SERVED, BASE_QUANTITIES, SUMMARY_FIELDS, STALENESS_FIELDS, NO_CODE, $, el, clear, fmt, link } = viewer;
  const { decode, stepsShown, fileChunk, sameprompt, quantities, tokenFields, colourTokens, appendGlyphNote } = viewer;
  const { stepPlace, versionText, staleBadge } = viewer;  // an asynchronous run's policy versions (viewer_versions.js)
  let pinned = null;  // the token span whose details show when the mouse is not on a token
  let current = null;  // the view the tokens on the page were drawn from
  let listKey = null;  // what the sample list was drawn for
  // a token verl's rollout correction took out of the mask: the policy's own, not a hole (docs/definitions.md#off-policy-tokens)
  const REJECTED_TEXT = "rejected by verl's rollout correction: the policy wrote this token, nothing trained on it";

  // ------------------------------------------------------------------ the run, the step, its responses

  function showError(error) {
    const box = $("error");
    box.textContent = String(error && error.message ? error.message : error);
    box.hidden = false;
    document.body.dataset.error = box.textContent;
  }

  function renderHeader(run) {
    $("title").textContent = `verl-ext view · ${run.path}`;
    const parts = [run.estimator, `${run.trainer} trainer`, `verl ${run.verl_version}`, `rollout ${run.rollout}`, `${run.steps.length} steps traced`];
    if (run.mode) parts.splice(2, 0, run.mode);  // an asynchronous trainer's mode and its settings
    parts.push(run.tokenizer ? `tokenizer ${run.tokenizer}` : "no tokenizer: tokens shown as ids");
    $("run-line").textContent = parts.join(" · ");
    const notes = clear($("notes"));
    // what the data says about the run as a whole: it did not finish, steps missing or that do not read
    for (const note of run.notes || []) notes.appendChild(el("div", { class: "note", text: `note: ${note}` }));
    if (run.tokenizer_problem) notes.appendChild(el("div", { class: "note", text: `note: ${run.tokenizer_problem}` }));
    appendGlyphNote(notes);
    if (!SERVED) {
      const inFile = DATA.steps_in_file.length;
      if (inFile < run.steps.length) {
        notes.appendChild(el("div", { class: "note", text: `this file holds ${inFile} of the ${run.steps.length} traced steps (${DATA.steps_in_file.join(", ")}); verl-ext view ${run.path} serves them all` }));
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
    if (s.rejected > 0) out.push(el("span", { class: "badge rejected", title: `${s.rejected} token(s) rejected by verl's rollout correction`, text: "rej" }));
    if (s.nonfinite) out.push(el("span", { class: "badge nonfinite", title: "a value is NaN, infinite or missing", text: "NaN" }));
    if (s.staleness > 0) out.push(staleBadge(s));
    if (s.tool_calls > 0) out.push(el("span", { class: "badge tool", title: `${s.tool_calls} tool call(s), ${s.turns} assistant turns`, text: "tool" }));
    return out;
  }

  function renderSampleList(view) {
    const list = $("sample-list");
    const chunk = fileChunk(view.step);
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
    box.appendChild(document.createTextNode(`${stepPlace(view.info)} `));
    const summary = stats && stats.summary;
    const items = [];  // [key, label, value, decimals]
    if (summary) for (const f of SUMMARY_FIELDS.concat(STALENESS_FIELDS || [])) items.push([f.key, f.label, summary[f.key], f.digits]);
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
    head.appendChild(document.createTextNode(` · uid ${meta.uid} · ${meta.rows} tokens (${meta.valid} valid) · score ${fmt(meta.score, 3)} · ${meta.truncated ? "truncated at the length limit" : meta.eos ? "ended with EOS" : "no EOS"}${meta.rejected ? ` · ${meta.rejected} rejected by verl's rollout correction (struck through)` : ""}${versionText(meta)}`));
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
    const turns = decode(chunk.turn), roles = decode(chunk.role), rejected = decode(chunk.rejected);  // null: no rejection in the run
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
      const valid = mask[row] === 1, dropped = rejected !== null && rejected[row] === 1;
      span.className = valid ? "tok" : dropped ? "tok rejected" : "tok masked";
      span.textContent = chunk.pieces[row];
      span.setAttribute("data-t", positions[row]);
      if (!(idNull && idNull[row] === 1)) span.setAttribute("data-id", ids[row]);
      span.setAttribute("data-mask", valid ? "1" : "0");
      if (rejected !== null) span.setAttribute("data-rejected", dropped ? "1" : "0");
      if (dropped) span.title = REJECTED_TEXT;
      span.setAttribute("data-turn", turns[row]);
      if (roles[row] !== NO_CODE) span.setAttribute("data-role", chunk.role_names[roles[row]]);
      if (!valid && !dropped && roles[row] !== NO_CODE) span.classList.add(`role-${chunk.role_names[roles[row]]}`);
      // the first token the policy wrote after a hole opens an assistant turn
      if ((valid || dropped) && row > view.begin && turns[row] !== turns[row - 1]) span.classList.add("turn-start");
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

  // A field's value as the details panel shows it.
  function display(field, v) {
    if (field.kind === "code") return field.text(v);
    if (field.kind === "flag") return v === 1 ? "yes" : "no";
    return fmt(v, 5);
  }

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
    const written = span.getAttribute("data-mask") === "1" ? "" : span.classList.contains("rejected") ? ` · ${REJECTED_TEXT}`
      : ` · masked (not trained)${role ? `, written by: ${role}` : ""}`;
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

  function showPinned() { showDetails(pinned); }

  Object.assign(viewer, {
    showError: showError, renderHeader: renderHeader, renderStepControls: renderStepControls,
    renderSampleList: renderSampleList, renderSummary: renderSummary, renderCheck: renderCheck, renderSample: renderSample,
    renderAcross: renderAcross, renderCompare: renderCompare, showDetails: showDetails, showPinned: showPinned,
  });
})(window.verlExtViewer);
