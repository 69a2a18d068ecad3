// The ledger page: reads the JSON endpoints and builds the DOM with textContent only, so any
// name the store holds is shown as text. Polls the context's version and re-reads on a change.
"use strict";

const POLL_MS = 1500;
const PAGE = {blocks: 50, grants: 50, retired: 50};
const COLOURS = {spent: "#D55E00", reserved: "#E69F00", free: "#0072B2"};  // Okabe-Ito
// One line per pipeline on the spent-budget chart (Okabe-Ito again; black is all grants').
const LINE_COLOURS = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9",
                      "#999999", "#F0E442"];
const REQUEST_SHOWN_CHARS = 60;  // a request's text in the table, before "show all"
const state = {context: null, version: null, offsets: {blocks: 0, grants: 0, retired: 0},
               plotly: null, loading: false};

async function api(path) {
  const response = await fetch(path, {credentials: "same-origin", cache: "no-store"});
  if (!response.ok) {
    throw new Error(`${path}: ${response.status} ${(await response.json()).detail || ""}`);
  }
  return response.json();
}

function node(tag, text, className) {
  const element = document.createElement(tag);
  if (text !== undefined && text !== null) element.textContent = String(text);
  if (className) element.className = className;
  return element;
}

// Numbers for people, 4 significant digits (0.1667, 1e-7): the JSON keeps the exact values.
function number(value, digits = 4) {
  if (value === null || value === undefined) return "—";
  const rounded = +Number(value).toPrecision(digits);
  return rounded !== 0 && Math.abs(rounded) < 1e-3 ? rounded.toExponential() : String(rounded);
}

function sum(values) {
  return Object.values(values || {}).reduce((total, value) => total + value, 0);
}

function fillRows(tbodyId, rows, cells, rowClass) {
  const body = document.getElementById(tbodyId);
  const fresh = document.createDocumentFragment();
  for (const row of rows) {
    const tr = node("tr", null, rowClass ? rowClass(row) : null);
    for (const cell of cells(row)) {
      tr.appendChild(cell instanceof Node ? cell : node("td", cell));
    }
    fresh.appendChild(tr);
  }
  body.replaceChildren(fresh);
}

function pager(id, total, key, reload) {
  const bar = document.getElementById(id);
  const offset = state.offsets[key];
  const last = Math.min(total, offset + PAGE[key]);
  const previous = node("button", "previous");
  previous.disabled = offset === 0;
  previous.onclick = () => { state.offsets[key] = Math.max(0, offset - PAGE[key]); reload(); };
  const next = node("button", "next");
  next.disabled = last >= total;
  next.onclick = () => { state.offsets[key] = offset + PAGE[key]; reload(); };
  const text = node("span", total ? `${offset + 1}–${last} of ${total}` : "none");
  bar.replaceChildren(previous, text, next);
}

function keyRange(row) {
  return row.start || row.end ? `${row.start || "…"} – ${row.end || "…"}` : "—";
}

// Plotly reads a subset of HTML in its labels: escape them so names stay text there too.
function plotText(text) {
  return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

// Asked for only once the tables are filled, and after that frame, so that compiling the chart
// library (1.2 MB) never holds back the tables: the charts draw when it arrives.
function loadPlotly(path) {
  if (state.plotly) return state.plotly;
  state.plotly = new Promise((resolve, reject) => {
    requestAnimationFrame(() => {
      const script = document.createElement("script");
      script.src = path;
      script.async = true;
      script.onload = () => resolve(window.Plotly);
      script.onerror = () => reject(new Error(`could not load ${path}`));
      document.head.appendChild(script);
    });
  });
  return state.plotly;
}

function drawBlocksChart(chart, Plotly) {
  const labels = chart.bars.map((bar) => plotText(bar.label));
  const traces = ["spent", "reserved", "free"].map((part) => ({
    type: "bar", name: part, x: labels, y: chart.bars.map((bar) => bar[part]),
    marker: {color: COLOURS[part]}, hovertemplate: `%{x}: ${part} %{y:.4g}<extra></extra>`}));
  document.getElementById("chart-note").textContent = chart.bars.length
    ? `${chart.unit}` + (chart.blocks_per_bar > 1
      ? `; each bar is the mean of ${chart.blocks_per_bar} consecutive blocks` : "")
    : "no blocks yet";
  return Plotly.react("chart-blocks", traces, {
    barmode: "stack", margin: {t: 10, b: 80, l: 50, r: 10}, height: 300,
    legend: {orientation: "h", y: 1.12}, xaxis: {type: "category", tickangle: -45},
    yaxis: {title: {text: chart.unit ? plotText(chart.unit) : ""}}}, {displayModeBar: false,
    responsive: true});
}

// Spent budget over time on one axis from zero: one line per pipeline (or front door) and,
// in black, all grants together; the server says in words what the numbers are.
function drawTimeline(line, Plotly) {
  document.getElementById("timeline-note").textContent = line.end_ms.length
    ? `${line.note} A point every ${Math.round(line.bucket_ms / 1000)} s; times in UTC.`
    : "no grants yet" + (line.without_epsilon ? ` with an ε. ${line.note}` : "");
  const times = [line.start_ms, ...line.end_ms].map((ms) => new Date(ms).toISOString());
  const trace = (name, values, style) => ({
    type: "scatter", mode: "lines", name: plotText(name), x: times, y: [0, ...values],
    line: style, hovertemplate: "ε %{y:.4g}"});
  const traces = line.end_ms.length ? [
    trace("all grants (the most-charged block)", line.all, {color: "#000000", width: 3}),
    ...line.series.map((series, index) => trace(
      series.name, series.values, {color: LINE_COLOURS[index % LINE_COLOURS.length], width: 2}))]
    : [];
  return Plotly.react("chart-timeline", traces, {
    margin: {t: 10, b: 40, l: 60, r: 10}, height: 320, hovermode: "x unified",
    legend: {orientation: "h", y: 1.02, yanchor: "bottom"},
    yaxis: {title: {text: plotText(line.axis)}, rangemode: "tozero", tickformat: ".4~g"}},
    {displayModeBar: false, responsive: true});
}

async function loadBlocks(context) {
  const page = await api(`/api/contexts/${encodeURIComponent(context)}/blocks?state=all` +
                         `&offset=${state.offsets.blocks}&limit=${PAGE.blocks}`);
  pager("blocks-pager", page.total, "blocks", () => loadBlocks(context));
  fillRows("blocks-body", page.rows, (row) => [
    node("td", row.id, "name"), row.retired ? "retired" : "live", number(row.budget.spent),
    number(sum(row.budget.reserved)), number(row.budget.free), number(row.epsilon_ceiling),
    number(row.guarantee_delta),
    row.budget.delta_reserved ? number(sum(row.budget.delta_reserved)) : "—",  // rdp: no delta
    number(row.delta_ceiling), row.charges,
    Object.entries(row.budget.reserved).filter(([, value]) => value > 0)
      .map(([name, value]) => `${name} ${number(value)}`).join(", ") || "—",
    keyRange(row)]);
}

async function loadRetired(context) {
  const page = await api(`/api/contexts/${encodeURIComponent(context)}/blocks?state=retired` +
                         `&offset=${state.offsets.retired}&limit=${PAGE.retired}`);
  pager("retired-pager", page.total, "retired", () => loadRetired(context));
  fillRows("retired-body", page.rows, (row) => [
    node("td", row.id, "name"), number(row.guarantee_epsilon), number(row.epsilon_ceiling),
    number(row.guarantee_delta), number(row.delta_ceiling), row.charges, keyRange(row)]);
}

function runButton(context, grant) {
  const cell = node("td");
  if (!grant.run_id) {
    cell.textContent = "—";
    return cell;
  }
  const button = node("button", grant.run_id, "run-link");
  button.onclick = () => showRun(context, grant.grant_id);
  cell.appendChild(button);
  return cell;
}

async function showRun(context, grantId) {
  const run = await api(`/api/contexts/${encodeURIComponent(context)}/grants/` +
                        `${encodeURIComponent(grantId)}/run`);
  document.getElementById("run").hidden = false;
  document.getElementById("run-grant").textContent = `${grantId} (${run.pipeline || "—"})`;
  document.getElementById("run-contexts").textContent = run.runs.length
    ? "run: " + run.runs.map((r) => `${r.name} (${r.type})`).join(", ") : "no run recorded";
  fillRows("run-body", run.artifacts, (a) => [a.type, a.name, node("td", a.uri, "uri"), a.state]);
}

// A request's text: its first characters on one line, the whole text (as written) on a click.
function requestCell(text) {
  const cell = node("td", null, "request");
  if (text === null || text === undefined) {
    cell.textContent = "—";
    return cell;
  }
  const line = text.split(/\s+/).join(" ").trim();
  if (line.length <= REQUEST_SHOWN_CHARS && !text.includes("\n")) {
    cell.textContent = text;
    return cell;
  }
  const details = node("details");
  details.appendChild(node("summary", line.length <= REQUEST_SHOWN_CHARS ? line
                                      : `${line.slice(0, REQUEST_SHOWN_CHARS - 1)}…`));
  details.appendChild(node("pre", text));
  cell.appendChild(details);
  return cell;
}

// The outcome, and why (a failure's reason, what a denied request's blocks had free) or what
// was released, on a click.
function outcomeCell(entry) {
  const cell = node("td", entry.outcome, "outcome");
  let why = [];
  if (entry.kind === "denial") {
    why = Object.entries(entry.free).map(([block, free]) => `${block} had ${free}`);
  } else {
    const reasons = new Set(entry.steps.map((s) => s.reason).filter((r) => r));
    const artifacts = new Set(entry.steps.flatMap((s) => s.artifacts));
    why = [...reasons];
    if (artifacts.size) why.push(`released ${[...artifacts].join(", ")}`);
  }
  if (why.length) {
    const details = node("details", null, "why");
    details.appendChild(node("summary", entry.kind === "denial" || entry.outcome !== "released"
                                        ? "why" : "what"));
    for (const line of why) details.appendChild(node("div", line));
    cell.appendChild(details);
  }
  return cell;
}

function blocksText(blocks) {
  return blocks.length > 6 ? `${blocks.slice(0, 6).join(", ")} … (${blocks.length})`
                           : blocks.join(", ");
}

async function loadGrants(context) {
  const page = await api(`/api/contexts/${encodeURIComponent(context)}/grants` +
                         `?offset=${state.offsets.grants}&limit=${PAGE.grants}`);
  pager("grants-pager", page.total, "grants", () => loadGrants(context));
  fillRows("grants-body", page.rows, (entry) => [
    entry.moment, outcomeCell(entry), node("td", entry.front_door || "—", "door"),
    node("td", entry.pipeline || "—", "name"),
    entry.kind === "denial" ? `${blocksText(Object.keys(entry.free))} could not pay`
                            : blocksText(entry.blocks),
    entry.epsilon === null ? "RDP curve" : number(entry.epsilon), number(entry.delta),
    entry.kind === "denial" ? "—" : splitText(entry.steps),
    requestCell(entry.request), runButton(context, entry)], (entry) => `outcome-${entry.outcome}`);
}

// A grant's split among DP steps, each with its fraction (rounded) and recorded event.
function splitText(steps) {
  return steps.filter((s) => s.fraction !== null)
    .map((s) => `${s.step} ${number(fractionValue(s.fraction))}` + (s.event ? `: ${s.event}` : ""))
    .join("; ") || "—";
}

// A split's fraction as recorded: a decimal ("0.9") or a ratio ("1/6").
function fractionValue(text) {
  const [top, bottom] = String(text).split("/");
  return bottom === undefined ? Number(top) : Number(top) / Number(bottom);
}

async function loadWaiting(context) {
  const held = await api(`/api/contexts/${encodeURIComponent(context)}/reservations`);
  fillRows("waiting-body", held.pipelines, (p) => [
    node("td", p.pipeline, "name"), p.waiting ? "yes" : "no (finished)", p.blocks,
    number(p.reserved), number(p.delta_reserved)]);
}

function showSummary(summary) {
  document.getElementById("context-name").textContent = summary.context;
  const items = [
    ["accounting", summary.accounting],
    ["minimum request ε", number(summary.min_request_epsilon)],
    ["blocks", `${summary.blocks} (${summary.live_blocks} live, ${summary.retired_blocks} ` +
               "retired)"],
    ["grants", `${summary.grants}` + (summary.grants ? ` (${Object.entries(summary.outcomes)
      .filter(([outcome]) => outcome !== "denied")
      .map(([outcome, count]) => `${count} ${outcome}`).join(", ")})` : "")],
    ["denials", summary.denials],
    ["waiting pipelines", summary.waiting_pipelines.join(", ") || "none"]];
  if (summary.guarantee) items.push(["guarantee", summary.guarantee]);
  const list = document.createDocumentFragment();
  for (const [term, value] of items) {
    list.appendChild(node("dt", term));
    list.appendChild(node("dd", value));
  }
  document.getElementById("summary").replaceChildren(list);
  document.getElementById("status").textContent =
    `read ${new Date(summary.read_at_ms).toLocaleTimeString()}`;
  const error = document.getElementById("error");
  error.hidden = !summary.error;
  error.textContent = summary.error ? `the store cannot be read now (${summary.error}); ` +
                                      "showing the last data read" : "";
}

async function loadContext(context, summary, plotlyPath) {
  state.loading = true;
  try {
    await drawContext(context, summary, plotlyPath);
  } finally {
    state.loading = false;
  }
}

async function drawContext(context, summary, plotlyPath) {
  showSummary(summary);
  const where = `/api/contexts/${encodeURIComponent(context)}`;
  const chartData = Promise.all([api(`${where}/chart`), api(`${where}/timeline`)]);
  await Promise.all([loadBlocks(context), loadGrants(context), loadWaiting(context),
                     loadRetired(context)]);
  // Milliseconds from navigation to the tables filled (benchmarks/ledger_web.py reads it).
  document.body.dataset.tablesReadyMs ||= String(Math.round(performance.now()));
  const [Plotly, [chart, line]] = await Promise.all([loadPlotly(plotlyPath), chartData]);
  await Promise.all([drawBlocksChart(chart, Plotly), drawTimeline(line, Plotly)]);
  state.version = summary.version;
  document.body.dataset.version = String(summary.version);
}

function contextButtons(contexts) {
  const nav = document.getElementById("contexts");
  nav.replaceChildren(...contexts.map((summary) => {
    const button = node("button", summary.context);
    button.setAttribute("aria-pressed", String(summary.context === state.context));
    button.onclick = () => { location.hash = encodeURIComponent(summary.context); };
    return button;
  }));
}

async function start() {
  const listing = await api("/api/contexts");
  const names = listing.contexts.map((c) => c.context);
  const wanted = decodeURIComponent(location.hash.slice(1));
  state.context = names.includes(wanted) ? wanted : names[0] || null;
  contextButtons(listing.contexts);
  if (state.context === null) {
    document.getElementById("context-name").textContent = "(the store has no ledger context)";
    return;
  }
  const summary = listing.contexts.find((c) => c.context === state.context);
  await loadContext(state.context, Object.assign({error: listing.error}, summary),
                    listing.plotly);
  document.body.dataset.ready = "true";
  // ... and to the whole page drawn, charts included.
  document.body.dataset.readyMs ||= String(Math.round(performance.now()));
}

async function poll() {
  if (state.context === null || state.loading) return;
  try {
    const summary = await api(`/api/contexts/${encodeURIComponent(state.context)}`);
    if (summary.version !== state.version) {
      const listing = await api("/api/contexts");
      contextButtons(listing.contexts);
      await loadContext(state.context, summary, listing.plotly);
    } else {
      showSummary(summary);
    }
  } catch (error) {
    showError(new Error(`cannot reach the ledger server: ${error.message}`));
  }
}

function showError(error) {
  const banner = document.getElementById("error");
  banner.hidden = false;
  banner.textContent = error.message;
}

document.addEventListener("DOMContentLoaded", () => {
  start().catch(showError);
  setInterval(poll, POLL_MS);
  window.addEventListener("hashchange", () => {
    state.offsets = {blocks: 0, grants: 0, retired: 0};
    state.version = null;
    start().catch(showError);
  });
});
