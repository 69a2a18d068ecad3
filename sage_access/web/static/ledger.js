// The ledger page: reads the JSON endpoints and builds the DOM with textContent only, so any
// name the store holds is shown as text. Polls the context's version and re-reads on a change.
"use strict";

const POLL_MS = 1500;
const PAGE = {blocks: 50, grants: 50, retired: 50};
const COLOURS = {spent: "#D55E00", reserved: "#E69F00", free: "#0072B2"};  // Okabe-Ito
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

function number(value, digits = 4) {
  if (value === null || value === undefined) return "—";
  if (value === 0) return "0";
  return Math.abs(value) < 1e-3 ? value.toExponential(2) : String(+value.toPrecision(digits));
}

function sum(values) {
  return Object.values(values || {}).reduce((total, value) => total + value, 0);
}

function fillRows(tbodyId, rows, cells) {
  const body = document.getElementById(tbodyId);
  const fresh = document.createDocumentFragment();
  for (const row of rows) {
    const tr = node("tr");
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

function drawTimeline(line, Plotly) {
  const times = line.buckets.map((bucket) => new Date(bucket.start_ms).toISOString());
  document.getElementById("timeline-note").textContent = line.buckets.length
    ? `grants and epsilon charged (epsilon × blocks) per ${Math.round(line.bucket_ms / 1000)} s`
    : "no grants yet";
  return Plotly.react("chart-timeline", [
    {type: "bar", name: "ε charged", x: times, y: line.buckets.map((b) => b.epsilon_charged),
     marker: {color: COLOURS.spent}},
    {type: "scatter", mode: "lines", name: "ε charged in total", x: times, yaxis: "y2",
     y: line.buckets.map((b) => b.epsilon_total), line: {color: COLOURS.free}},
    {type: "scatter", mode: "markers", name: "grants", x: times, yaxis: "y3",
     y: line.buckets.map((b) => b.grants), marker: {color: "#009E73", size: 5}},
  ], {margin: {t: 10, b: 40, l: 50, r: 50}, height: 280, legend: {orientation: "h", y: 1.15},
      xaxis: {domain: [0, 0.9]}, yaxis: {title: {text: "ε per bucket"}},
      yaxis2: {overlaying: "y", side: "right", title: {text: "ε total"}},
      yaxis3: {overlaying: "y", side: "right", position: 1, showgrid: false,
               title: {text: "grants"}, anchor: "free"}},
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

async function loadGrants(context) {
  const page = await api(`/api/contexts/${encodeURIComponent(context)}/grants` +
                         `?offset=${state.offsets.grants}&limit=${PAGE.grants}`);
  pager("grants-pager", page.total, "grants", () => loadGrants(context));
  fillRows("grants-body", page.rows, (grant) => [
    grant.moment, node("td", grant.pipeline || "—", "name"),
    grant.blocks.length > 6 ? `${grant.blocks.slice(0, 6).join(", ")} … (${grant.blocks.length})`
                            : grant.blocks.join(", "),
    grant.epsilon === null ? "RDP curve" : number(grant.epsilon), number(grant.delta),
    grant.steps.map((s) => `${s.step} ${s.fraction}` + (s.event ? `: ${s.event}` : ""))
      .join("; ") || "—",
    runButton(context, grant)]);
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
    ["accounting", summary.accounting], ["minimum request ε", summary.min_request_epsilon],
    ["blocks", `${summary.blocks} (${summary.live_blocks} live, ${summary.retired_blocks} ` +
               "retired)"],
    ["grants", summary.grants],
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
