// verl-ext view, the state its scripts share: the page's data, what the data's fields are, and the view
// in the URL's hash. The viewer's scripts are plain scripts (no build step, no ES modules: the page is
// one file), inlined in a fixed order (verl_ext/view/page.py's SCRIPTS), this one first; each adds what
// it offers to one namespace object, window.verlExtViewer, and takes from it only what earlier ones added.
// State lives in the URL's hash (#step=5&sample=3&colour=value&epoch=0&filter=wrong&token=4), so a link
// shows the same thing and the browser's back button works.
(function () {
  "use strict";

  const DATA = JSON.parse(document.getElementById("verl-ext-data").textContent);
  // What the data's fields are, sent with the data from their records (verl_ext.view.payload.page_schema):
  // nothing in the viewer names a column, a summary field or a comparison statistic.
  const UPDATE_COLUMNS = DATA.update_columns;  // [{name, kind: float | int | code | flag}], in the schema's order
  // What a token can be coloured by: [{key, label, kind, name, centre?, categorical?}]. kind: column
  // (token table), delta (td0's re-estimate), update (the chosen PPO epoch's row), difference (of two
  // token columns); "estimate" (a re-estimated raw advantage) is added per estimator of the step.
  const BASE_QUANTITIES = DATA.quantities;
  const FILTERS = {
    all: () => true,
    wrong: (s) => s.wrong,
    truncated: (s) => s.truncated,
    clipped: (s) => s.clipped,
    nonfinite: (s) => s.nonfinite,
    rejected: (s) => s.rejected > 0,
    stale: (s) => s.staleness > 0,
    tool: (s) => s.tool_calls > 0,
    notool: (s) => s.tool_calls === 0,
  };

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

  function hrefFor(changes) { return "#" + encodeState(Object.assign({}, readState(), changes)); }

  window.verlExtViewer = {
    DATA: DATA,
    SERVED: DATA.mode === "served",
    CLIP_CODES: DATA.clip_codes,  // the update tables' code columns (clip) index it
    COLUMNS: DATA.float_columns,  // the token table's float columns, in the schema's order
    UPDATE_COLUMNS: UPDATE_COLUMNS,
    UPDATE_KIND: Object.fromEntries(UPDATE_COLUMNS.map((c) => [c.name, c.kind])),
    SUMMARY_FIELDS: DATA.summary_fields,  // [{key, label, digits}] of the summary row the step line shows
    STALENESS_FIELDS: DATA.staleness_fields,  // the same, of an asynchronous run's summary row (absent otherwise)
    BASE_QUANTITIES: BASE_QUANTITIES,
    CLIP_COLOURS: DATA.clip_colours,  // clip code -> the colour of its tokens
    CLIP_NONE: DATA.clip_none,  // the code of an unclipped token (light: dark text on it)
    NO_CODE: DATA.no_code,  // a code column's index where the code is null or unknown (a role no agent loop recorded)
    FILTERS: FILTERS,
    readState: readState,
    go: go,
    hrefFor: hrefFor,
  };
})();
