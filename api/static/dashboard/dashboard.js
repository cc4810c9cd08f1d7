// The KV cache dashboard: draws the scheduler's snapshots (common/kv_view.py's JSON), live from
// /dashboard/events or replayed from a --kv-trace file. The block map is a plain canvas; the time series are
// Chart.js (vendored, api/static/dashboard/VENDORED.txt).
"use strict";

const STATES = ["free", "cached", "used", "shared"];
const COLORS = { free: "#e3e6ea", cached: "#9fd8ac", shared: "#1f2230", unlisted: "#8a8f98" };
const MAX_POINTS = 240; // a minute of live snapshots at 4 a second

const dashboard = {
  cellCounts: { free: 0, cached: 0, used: 0, shared: 0 }, // cells drawn in each state, last frame
  last: null, // the snapshot on screen
  selected: null, // request_id whose blocks are highlighted
  history: [], // snapshots the charts are drawn from (live: the last MAX_POINTS)
  frames: [], // a loaded trace
  source: null, // the live EventSource
  playing: null,
};
window.dashboard = dashboard;

// A stable hue per request: FNV-1a of its id, then a finalizer (MurmurHash3's fmix32) so that ids that
// differ in their last character (an api's "<id>-1", "<id>-2") get far-apart hues.
function hueOf(requestId) {
  let h = 0x811c9dc5;
  for (let i = 0; i < requestId.length; i++) {
    h ^= requestId.charCodeAt(i);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b) >>> 0;
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35) >>> 0;
  h ^= h >>> 16;
  return (h >>> 0) % 360;
}
function requestColor(requestId) {
  return `hsl(${hueOf(requestId)}, 70%, 52%)`;
}

// ---------------------------------------------------------------------------------------------------------
// the block map

function cellsOf(snapshot) {
  const states = [];
  const owners = [];
  const runs = snapshot.cells; // flat: state, owner, length, ...
  for (let r = 0; r + 2 < runs.length; r += 3) {
    for (let i = 0; i < runs[r + 2]; i++) {
      states.push(runs[r]);
      owners.push(runs[r + 1]);
    }
  }
  return { states, owners };
}

function selectedCells(snapshot) {
  const row = snapshot.requests.find((r) => r.request_id === dashboard.selected);
  if (!row) return null;
  const cells = new Set();
  const runs = row.block_runs; // flat: first block id, count, ...
  for (let r = 0; r + 1 < runs.length; r += 2) {
    for (let b = runs[r]; b < runs[r] + runs[r + 1]; b++) cells.add(Math.floor(b / snapshot.blocks_per_cell));
  }
  return cells;
}

function drawMap(snapshot) {
  const canvas = document.getElementById("map");
  const { states, owners } = cellsOf(snapshot);
  const n = Math.max(1, states.length);
  const width = canvas.clientWidth || 800;
  const size = Math.max(3, Math.min(24, Math.floor(Math.sqrt((width * 260) / n))));
  const cols = Math.max(1, Math.floor(width / size));
  const rows = Math.ceil(n / cols);
  canvas.width = cols * size;
  canvas.height = rows * size;
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const highlight = selectedCells(snapshot);
  const counts = { free: 0, cached: 0, used: 0, shared: 0 };
  const gap = size >= 6 ? 1 : 0;
  for (let i = 0; i < states.length; i++) {
    const state = STATES[states[i]];
    counts[state] += 1;
    let color = COLORS[state];
    if (state === "used") {
      const row = snapshot.requests[owners[i] - 1];
      color = row ? requestColor(row.request_id) : COLORS.unlisted;
    }
    ctx.globalAlpha = highlight && !highlight.has(i) ? 0.2 : 1;
    ctx.fillStyle = color;
    ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, size - gap, size - gap);
    if (highlight && highlight.has(i) && size >= 6) {
      ctx.globalAlpha = 1;
      ctx.strokeStyle = "#d00000";
      ctx.lineWidth = 2;
      ctx.strokeRect((i % cols) * size + 1, Math.floor(i / cols) * size + 1, size - gap - 2, size - gap - 2);
    }
  }
  ctx.globalAlpha = 1;
  dashboard.cellCounts = counts;
  canvas.dataset.free = counts.free;
  canvas.dataset.cached = counts.cached;
  canvas.dataset.used = counts.used;
  canvas.dataset.shared = counts.shared;
  const per = snapshot.blocks_per_cell;
  document.getElementById("grouping").textContent =
    `${snapshot.num_blocks} blocks of ${snapshot.block_size} tokens` +
    (per > 1 ? `; one cell = ${per} consecutive blocks, coloured by the state most of them are in` : "; one cell per block");
  const legend = document.getElementById("legend");
  const swatch = (color) => `<span class="swatch" style="background:${color}"></span>`;
  legend.innerHTML =
    `<span>${swatch(COLORS.free)}free ${snapshot.num_blocks - snapshot.blocks_used - snapshot.blocks_cached}</span>` +
    `<span>${swatch(COLORS.cached)}cached, reusable ${snapshot.blocks_cached}</span>` +
    `<span>${swatch("linear-gradient(90deg,#e74c3c,#f1c40f,#2ecc71,#3498db)")}in use (one hue per request) ${snapshot.blocks_used - snapshot.blocks_shared}</span>` +
    `<span>${swatch(COLORS.shared)}shared (ref count &gt; 1) ${snapshot.blocks_shared}</span>` +
    `<span>swapped out to CPU: ${snapshot.cpu_blocks_used} of ${snapshot.num_cpu_blocks} blocks</span>` +
    (snapshot.num_host_tier_blocks
      ? `<span id="host-tier">host tier: ${snapshot.host_tier_blocks_used} of ${snapshot.num_host_tier_blocks} blocks, ${snapshot.host_tier_hits_total} loaded back</span>`
      : "") +
    (snapshot.num_disk_tier_blocks
      ? `<span id="disk-tier">disk tier: ${snapshot.disk_tier_blocks_used} of ${snapshot.num_disk_tier_blocks} blocks</span>`
      : "");
}

// ---------------------------------------------------------------------------------------------------------
// the table

function fmtAge(s) {
  return s < 60 ? `${s.toFixed(1)} s` : `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}

function drawTable(snapshot) {
  const body = document.querySelector("#requests tbody");
  body.textContent = "";
  for (const row of snapshot.requests) {
    const tr = document.createElement("tr");
    tr.dataset.requestId = row.request_id;
    if (row.request_id === dashboard.selected) tr.className = "selected";
    const cells = [
      null, row.request_id, row.state, row.num_seqs, row.num_prompt_tokens, row.num_output_tokens,
      row.num_blocks, row.num_shared_blocks, row.num_cached_tokens, row.num_cpu_blocks, fmtAge(row.age_s),
    ];
    for (const value of cells) {
      const td = document.createElement("td");
      if (value === null) {
        td.innerHTML = `<span class="swatch" style="background:${requestColor(row.request_id)}"></span>`;
      } else {
        td.textContent = value;
      }
      tr.appendChild(td);
    }
    tr.addEventListener("click", () => {
      dashboard.selected = dashboard.selected === row.request_id ? null : row.request_id;
      drawMap(dashboard.last);
      drawTable(dashboard.last);
    });
    body.appendChild(tr);
  }
  const more = snapshot.num_requests - snapshot.requests.length;
  document.getElementById("table-note").textContent =
    `${snapshot.num_requests} live` + (more > 0 ? ` (${more} more not listed)` : "") + "; click one to find its blocks";
}

// ---------------------------------------------------------------------------------------------------------
// the time series

const charts = {};

function lineChart(id, title, series, yLabel) {
  return new Chart(document.getElementById(id), {
    type: "line",
    data: { labels: [], datasets: series.map(([label, color]) => ({ label, borderColor: color, backgroundColor: color, data: [], pointRadius: 0, borderWidth: 1.5 })) },
    options: {
      animation: false,
      maintainAspectRatio: false,
      plugins: { title: { display: true, text: title }, legend: { labels: { boxWidth: 10 } } },
      scales: { x: { title: { display: true, text: "s" }, ticks: { maxTicksLimit: 8 } }, y: { beginAtZero: true, title: { display: !!yLabel, text: yLabel } } },
    },
  });
}

function setupCharts() {
  charts.blocks = lineChart("chart-blocks", "KV blocks", [["used", "#e67e22"], ["cached", "#27ae60"], ["free", "#95a5a6"], ["shared", "#1f2230"]]);
  charts.waste = lineChart("chart-waste", "KV waste (allocated slots not yet written)", [["waste %", "#c0392b"]], "%");
  charts.requests = lineChart("chart-requests", "Sequences", [["running", "#2980b9"], ["waiting", "#f39c12"], ["swapped", "#8e44ad"]]);
  charts.events = lineChart("chart-events", "Preemptions and swaps per second", [["preemptions", "#c0392b"], ["swap outs", "#8e44ad"], ["swap ins", "#16a085"]]);
  charts.tokens = lineChart("chart-tokens", "Tokens per second", [["prompt", "#2c3e50"], ["output", "#27ae60"]]);
}

function rate(prev, cur, key) {
  const dt = cur.time_s - prev.time_s;
  return prev && dt > 0 ? Math.max(0, (cur[key] - prev[key]) / dt) : 0;
}

function drawCharts(history) {
  if (!history.length) return;
  const t0 = history[0].time_s;
  const labels = history.map((s) => (s.time_s - t0).toFixed(1));
  const column = (f) => history.map((s, i) => f(s, i > 0 ? history[i - 1] : s));
  const set = (chart, columns) => {
    chart.data.labels = labels;
    columns.forEach((data, i) => (chart.data.datasets[i].data = data));
    chart.update();
  };
  set(charts.blocks, [
    column((s) => s.blocks_used), column((s) => s.blocks_cached),
    column((s) => s.num_blocks - s.blocks_used - s.blocks_cached), column((s) => s.blocks_shared),
  ]);
  set(charts.waste, [column((s) => (s.slots_allocated ? (100 * (s.slots_allocated - s.slots_used)) / s.slots_allocated : 0))]);
  set(charts.requests, [column((s) => s.num_running_seqs), column((s) => s.num_waiting_seqs), column((s) => s.num_swapped_seqs)]);
  set(charts.events, [
    column((s, p) => rate(p, s, "preemptions_total")), column((s, p) => rate(p, s, "swap_outs_total")),
    column((s, p) => rate(p, s, "swap_ins_total")),
  ]);
  set(charts.tokens, [column((s, p) => rate(p, s, "prompt_tokens_total")), column((s, p) => rate(p, s, "generated_tokens_total"))]);
}

function show(snapshot) {
  dashboard.last = snapshot;
  drawMap(snapshot);
  drawTable(snapshot);
}

// ---------------------------------------------------------------------------------------------------------
// live

function setStatus(text) {
  document.getElementById("status").textContent = text;
}

function goLive() {
  stopPlaying();
  dashboard.history = [];
  document.getElementById("mode").textContent = "live";
  document.getElementById("mode").className = "";
  document.getElementById("replay-controls").hidden = true;
  const source = new EventSource("/dashboard/events");
  dashboard.source = source;
  source.onmessage = (event) => {
    const snapshot = JSON.parse(event.data);
    dashboard.history.push(snapshot);
    if (dashboard.history.length > MAX_POINTS) dashboard.history.shift();
    show(snapshot);
    drawCharts(dashboard.history);
    setStatus(`updated ${new Date(snapshot.time_s * 1000).toLocaleTimeString()}`);
  };
  source.addEventListener("problem", (event) => setStatus(JSON.parse(event.data)));
  source.onerror = () => setStatus("disconnected; retrying…");
}

// ---------------------------------------------------------------------------------------------------------
// replay

function stopPlaying() {
  if (dashboard.playing !== null) clearTimeout(dashboard.playing);
  dashboard.playing = null;
  document.getElementById("play").textContent = "Play";
}

function showFrame(index) {
  const frames = dashboard.frames;
  document.getElementById("frame").value = index;
  const t = frames[index].time_s - frames[0].time_s;
  document.getElementById("frame-label").textContent = `${index + 1} / ${frames.length} (${t.toFixed(1)} s)`;
  show(frames[index]);
  drawCharts(frames.slice(Math.max(0, index + 1 - MAX_POINTS), index + 1));
}

function play() {
  const frames = dashboard.frames;
  const step = () => {
    const index = Number(document.getElementById("frame").value);
    if (index + 1 >= frames.length) return stopPlaying();
    showFrame(index + 1);
    const wait = (frames[index + 1 + (index + 2 < frames.length ? 1 : 0)].time_s - frames[index + 1].time_s) * 1000;
    dashboard.playing = setTimeout(step, Math.min(1000, Math.max(30, wait)));
  };
  document.getElementById("play").textContent = "Pause";
  dashboard.playing = setTimeout(step, 0);
}

function loadTrace(text) {
  const lines = text.split("\n").filter((line) => line.trim());
  const header = lines.length ? JSON.parse(lines[0]) : {};
  if (!String(header.format || "").startsWith("pagedserve-kv-trace/")) {
    setStatus("not a pagedserve KV trace (its first line names the format)");
    return;
  }
  const frames = lines.slice(1).map((line) => JSON.parse(line)).filter((f) => f.cells);
  if (!frames.length) {
    setStatus("the trace holds no snapshot");
    return;
  }
  if (dashboard.source) dashboard.source.close();
  dashboard.source = null;
  dashboard.frames = frames;
  document.getElementById("mode").textContent = "replay";
  document.getElementById("mode").className = "replay";
  document.getElementById("replay-controls").hidden = false;
  const slider = document.getElementById("frame");
  slider.max = frames.length - 1;
  const truncated = lines.some((line) => line.includes('"truncated"'));
  setStatus(`trace: ${frames.length} snapshots, policy ${header.kv_policy || "?"}${truncated ? " (truncated at its size bound)" : ""}`);
  showFrame(0);
}

function setup() {
  setupCharts();
  document.getElementById("trace-file").addEventListener("change", (event) => {
    const file = event.target.files[0];
    if (file) file.text().then(loadTrace);
  });
  document.getElementById("frame").addEventListener("input", (event) => {
    stopPlaying();
    showFrame(Number(event.target.value));
  });
  document.getElementById("play").addEventListener("click", () => (dashboard.playing === null ? play() : stopPlaying()));
  document.getElementById("live").addEventListener("click", goLive);
  dashboard.loadTrace = loadTrace;
  goLive();
}

setup();
