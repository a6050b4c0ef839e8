// verl-ext view: what the page draws for the view in the URL's hash, in which order, and the controls
// and keys that change that view; the scripts before this one provide the state, the data, the colours
// and the drawing (no dependencies, no network beyond its own server in served mode).
(function (viewer) {
  "use strict";

  const { SERVED, DATA, FILTERS, readState, go, $ } = viewer;
  const { run, stepsShown, defaultStep, overview, sampleRows, statistics, knownStatistics } = viewer;
  const { colourRules, colourTokens, checkGlyphs, showError, showDetails, showPinned } = viewer;
  const { renderHeader, renderStepControls, renderSampleList, renderCheck, renderSummary, renderSample, renderCompare, renderAcross } = viewer;
  let renderCount = 0;

  async function render() {
    const mine = ++renderCount;
    const stale = () => mine !== renderCount;
    const began = performance.now();
    $("error").hidden = true;
    try {
      const runInfo = await run();
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
      renderHeader(runInfo);
      renderStepControls(view);
      renderSampleList(view);
      renderCheck(view, null);
      renderSummary(view, null);
      const rows = sample === null ? null : await sampleRows(step, sample);
      if (stale()) return;
      if (rows) Object.assign(view, rows);
      view.stats = knownStatistics(step);  // known: coloured once
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
    response.addEventListener("mouseleave", showPinned);
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
})(window.verlExtViewer);
