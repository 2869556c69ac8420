// The run's dashboard: one EventSource on /events, the state it sends drawn with plain DOM and canvas.
"use strict";

const COLORS = ["#2d62c8", "#d1495b", "#1a7f4b", "#a15c00", "#7a3fb8", "#00798c", "#c2185b", "#5d6b00"];
const RECORD = new Set(["step", "rounds", "paper_rounds", "time_s", "dist_x", "dist_z", "grad_norm", "residual", "epsilon"]);
const LOG_SCALE = new Set(["dist_x", "dist_z", "grad_norm", "residual"]);
const TITLES = { dist_x: "||x - x*||", dist_z: "||z - z*||", grad_norm: "||G(z)||", residual: "residual ||z - P(z - G(z))||",
  epsilon: "DP epsilon spent" };
const curves = {};  // algorithm -> its points so far
let last = null;

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(value, digits) {
  if (value === null || value === undefined || Number.isNaN(value)) return "-";
  if (Math.abs(value) !== 0 && (Math.abs(value) < 1e-3 || Math.abs(value) >= 1e5)) return value.toExponential(digits || 3);
  return Number(value.toPrecision(digits || 4)).toString();
}

function row(cells) {
  const tr = el("tr");
  for (const [text, cls] of cells) tr.appendChild(el("td", cls ? { class: cls } : {}, text));
  return tr;
}

function render(state) {
  last = state;
  document.getElementById("run").textContent = state.run;
  document.getElementById("problem").textContent =
    `${state.problem}, ${state.clients_expected} clients, budget ${state.budget} rounds (${state.convention})`;
  document.getElementById("axis").textContent = `against communication rounds (${state.convention})`;
  const badge = document.getElementById("outcome");
  if (state.outcome) {
    badge.textContent = state.outcome.failure ? `failed: ${state.outcome.failure}` : "finished";
    badge.className = "badge " + (state.outcome.failure ? "failed" : "ok");
  } else {
    const running = state.algorithms.find((a) => a.status === "running");
    badge.textContent = running ? `running ${running.name}` : "waiting for clients";
    badge.className = "badge " + (running ? "running" : "waiting");
  }
  for (const [name, points] of Object.entries(state.points)) (curves[name] = curves[name] || []).push(...points);
  renderAlgorithms(state);
  renderClients(state);
  renderTraffic(state);
  renderTransport(state);
  drawCharts(state);
  document.getElementById("updated").textContent = `Updated ${new Date().toLocaleTimeString()}.`;
}

function renderAlgorithms(state) {
  const body = document.querySelector("#algorithms tbody");
  body.replaceChildren();
  state.algorithms.forEach((a) => {
    const tr = el("tr", { "data-algorithm": a.name });
    tr.appendChild(el("td", {}, a.name));
    tr.appendChild(el("td", { class: `state status ${a.status}` }, a.status));
    const bar = el("div", { class: "bar" });
    const fill = el("div");
    fill.style.width = `${Math.min(100, (100 * a.rounds) / state.budget)}%`;
    bar.appendChild(fill);
    const cell = el("td");
    cell.appendChild(bar);
    tr.appendChild(cell);
    tr.appendChild(el("td", { class: "num rounds" }, String(a.rounds)));
    tr.appendChild(el("td", { class: "num steps" }, String(a.steps)));
    tr.appendChild(el("td", { class: "num dist" }, fmt(a.last.dist_x)));
    tr.appendChild(el("td", { class: "num grad" }, fmt(a.last.grad_norm)));
    tr.appendChild(el("td", { class: "num wall" }, a.wall_s.toFixed(2)));
    body.appendChild(tr);
  });
}

function renderClients(state) {
  const body = document.querySelector("#clients tbody");
  body.replaceChildren();
  const joined = state.clients.filter((c) => c.state === "joined").length;
  document.getElementById("joined").textContent = `${joined} of ${state.clients_expected} joined`;
  for (const c of state.clients) {
    const tr = el("tr", { "data-client": String(c.index) });
    tr.appendChild(el("td", { class: "num" }, String(c.index)));
    tr.appendChild(el("td", { class: "address" }, c.address === undefined ? "-" : c.address || "-"));
    tr.appendChild(el("td", { class: `state ${c.state}` }, c.state));
    tr.appendChild(el("td", { class: "num latency" }, c.latency_s === null ? "-" : (1e3 * c.latency_s).toFixed(2)));
    body.appendChild(tr);
  }
  document.getElementById("secure-note").hidden = !state.secure_aggregation;
}

function renderTraffic(state) {
  const body = document.querySelector("#traffic tbody");
  body.replaceChildren();
  for (const a of state.algorithms) {
    for (const [category, t] of Object.entries(a.traffic)) {
      if (!t.rounds && !t.messages_down && !t.bytes_down) continue;
      const tr = row([
        [a.name], [category], [String(t.rounds), "num rounds"],
        [`${t.messages_down}/${t.messages_up}`, "num messages"],
        [`${(t.bytes_down / 1e6).toFixed(3)}/${(t.bytes_up / 1e6).toFixed(3)}`, "num megabytes"],
      ]);
      tr.setAttribute("data-algorithm", a.name);
      tr.setAttribute("data-category", category);
      tr.setAttribute("data-bytes", String(t.bytes_down + t.bytes_up));
      body.appendChild(tr);
    }
  }
}

function renderTransport(state) {
  const dl = document.getElementById("transport");
  dl.replaceChildren();
  const add = (term, value) => { dl.appendChild(el("dt", {}, term)); dl.appendChild(el("dd", {}, value)); };
  const refused = Object.entries(state.refusals).map(([k, v]) => `${k} ${v}`).join(", ");
  add("refusals", refused || "none");
  const closed = state.connections_closed;
  add("connections closed", `silent ${closed.silent || 0}, over an address's cap ${closed.over_peer_cap || 0}`);
  add("held off", String(closed.held_off || 0));
  if (state.secure_aggregation) add("secure aggregation", `dropouts ${state.secure.dropouts}, recovered ${state.secure.recoveries}`);
  if (state.outcome) add("run directory", state.outcome.run_dir);
  add("elapsed", `${state.elapsed_s.toFixed(1)} s`);
}

function measures() {
  const found = [];
  for (const points of Object.values(curves)) {
    for (const p of points) for (const k of Object.keys(p)) if (!found.includes(k) && (!RECORD.has(k) || k in TITLES)) found.push(k);
  }
  const order = ["dist_x", "dist_z", "grad_norm", "residual"];
  return found.sort((a, b) => (order.includes(a) ? order.indexOf(a) : 9) - (order.includes(b) ? order.indexOf(b) : 9));
}

function drawCharts(state) {
  const holder = document.getElementById("charts");
  const names = measures();
  document.getElementById("no-curves").hidden = names.length > 0;
  for (const name of names) {
    let canvas = holder.querySelector(`canvas[data-measure="${name}"]`);
    if (!canvas) {
      const box = el("div", { class: "chart" });
      box.appendChild(el("h3", {}, TITLES[name] || `${name} (evaluation, mean over clients)`));
      canvas = el("canvas", { "data-measure": name });
      box.appendChild(canvas);
      box.appendChild(el("div", { class: "legend" }));
      holder.appendChild(box);
    }
    drawChart(canvas, name, state);
  }
}

function drawChart(canvas, measure, state) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = width * ratio; canvas.height = height * ratio;
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  const log = LOG_SCALE.has(measure);
  const key = state.round_key;
  const series = [];
  let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
  Object.entries(curves).forEach(([name, points], i) => {
    const xy = points.filter((p) => p[measure] !== undefined && p[measure] !== null && (!log || p[measure] > 0))
      .map((p) => [p[key], log ? Math.log10(p[measure]) : p[measure]]).filter(([, y]) => Number.isFinite(y));
    if (!xy.length) return;
    series.push([name, xy, COLORS[i % COLORS.length]]);
    for (const [x, y] of xy) { x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y); }
  });
  g.clearRect(0, 0, width, height);
  if (!series.length) return;
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
  let ticks = [0, 1, 2, 3, 4].map((k) => y0 + ((y1 - y0) * k) / 4);
  if (log) {  // whole decades
    y0 = Math.floor(y0); y1 = Math.ceil(y1);
    const every = Math.max(1, Math.ceil((y1 - y0) / 5));
    ticks = [];
    for (let y = y0; y <= y1; y += every) ticks.push(y);
  }
  const left = 58, right = 10, top = 8, bottom = 26;
  const px = (x) => left + ((x - x0) / (x1 - x0)) * (width - left - right);
  const py = (y) => top + (1 - (y - y0) / (y1 - y0)) * (height - top - bottom);
  g.font = "11px system-ui, sans-serif";
  g.strokeStyle = "#e3e6ec"; g.fillStyle = "#6b7385"; g.lineWidth = 1;
  for (const y of ticks) {
    g.beginPath(); g.moveTo(left, py(y)); g.lineTo(width - right, py(y)); g.stroke();
    g.textAlign = "right"; g.fillText(log ? `1e${y}` : fmt(y, 3), left - 6, py(y) + 4);
  }
  for (let k = 0; k <= 4; k++) {
    const x = x0 + ((x1 - x0) * k) / 4;
    g.textAlign = "center"; g.fillText(String(Math.round(x)), px(x), height - 8);
  }
  for (const [, xy, color] of series) {
    g.strokeStyle = color; g.lineWidth = 1.8; g.beginPath();
    xy.forEach(([x, y], j) => (j ? g.lineTo(px(x), py(y)) : g.moveTo(px(x), py(y))));
    g.stroke();
  }
  const legend = canvas.parentElement.querySelector(".legend");
  legend.replaceChildren();
  for (const [name, , color] of series) {
    const item = el("span");
    const swatch = el("i");
    swatch.style.background = color;
    item.appendChild(swatch);
    item.appendChild(document.createTextNode(name));
    legend.appendChild(item);
  }
}

function connect() {
  const source = new EventSource("/events");
  source.onopen = () => { for (const name of Object.keys(curves)) delete curves[name]; };  // sent again in full
  source.onmessage = (event) => render(JSON.parse(event.data));
  source.onerror = () => {
    const badge = document.getElementById("outcome");
    if (last && last.outcome) { source.close(); return; }  // the run is over and the monitor has gone
    badge.textContent = "reconnecting";
    badge.className = "badge waiting";
  };
  window.addEventListener("resize", () => last && drawCharts(last));
}

connect();
