// The run page: reads api/run every few seconds and draws it. Everything a peer wrote (ids,
// roles, endpoints) goes into the page as text, never as markup.
"use strict";

const REFRESH_MS = Number(document.body.dataset.refreshMs) || 5000;
const LAYOUT = {
  margin: { l: 50, r: 10, t: 10, b: 80 },
  legend: { orientation: "h", x: 0, y: -0.3, yanchor: "top" },
};
const CONFIG = { displaylogo: false, responsive: true, displayModeBar: "hover" };

function text(id, value) {
  document.getElementById(id).textContent = value;
}

function cell(row, value, className) {
  const td = document.createElement("td");
  td.textContent = value;
  if (className) td.className = className;
  row.appendChild(td);
}

function fixed(value, digits) {
  return value === null || value === undefined ? "-" : Number(value).toFixed(digits);
}

function bytes(value) {
  if (value === null || value === undefined) return "-";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let shown = value, unit = 0;
  while (shown >= 1000 && unit < units.length - 1) { shown /= 1000; unit += 1; }
  return `${shown.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

function drawLoss(node) {
  const rounds = node && node.rounds ? node.rounds : [];
  const epochs = rounds.map((r) => r.epoch);
  Plotly.react("loss-plot", [
    { x: epochs, y: rounds.map((r) => r.val_loss), name: "validation", mode: "lines+markers" },
    { x: epochs, y: rounds.map((r) => r.train_loss), name: "train", mode: "lines" },
  ], { ...LAYOUT, xaxis: { title: { text: "epoch" } }, yaxis: { title: { text: "loss" } } }, CONFIG);
  document.getElementById("loss-note").hidden = rounds.length > 0;
  return rounds.length;
}

function drawRounds(node) {
  const rounds = node && node.rounds ? node.rounds : [];
  const epochs = rounds.map((r) => r.epoch);
  const part = (name, key) => ({ x: epochs, y: rounds.map((r) => r[key]), name, type: "bar" });
  Plotly.react("rounds-plot", [
    part("matchmaking and waiting", "matchmaking_seconds"),
    part("all-reduce", "allreduce_seconds"),
    part("outer step", "outer_seconds"),
  ], { ...LAYOUT, barmode: "stack", xaxis: { title: { text: "epoch" } },
       yaxis: { title: { text: "seconds" } } }, CONFIG);
  return rounds.length;
}

function drawPeers(peers) {
  const colour = { direct: "#2b7a3d", upnp: "#3b6fb6", relayed: "#c77c02", unreachable: "#a11" };
  Plotly.react("peers-plot", [{
    type: "bar",
    x: peers.map((p) => p.peer_id.slice(0, 10)),
    y: peers.map((p) => p.throughput),
    text: peers.map((p) => p.reachability),
    marker: { color: peers.map((p) => colour[p.reachability] || "#777") },
  }], { ...LAYOUT, yaxis: { title: { text: "samples/s" } } }, CONFIG);
  return peers.length;
}

function fillPeers(peers) {
  const body = document.querySelector("#peers tbody");
  body.replaceChildren();
  for (const peer of peers) {
    const row = document.createElement("tr");
    row.dataset.peer = peer.peer_id;
    cell(row, peer.peer_id);
    cell(row, peer.role);
    cell(row, String(peer.epoch));
    cell(row, fixed(peer.throughput, 1), "num");
    cell(row, `${fixed(100 * (peer.share || 0), 0)}%`, "num");
    cell(row, peer.reachability + (peer.via ? ` via ${peer.via.slice(0, 10)}` : ""));
    cell(row, peer.trust ? fixed(peer.trust.cosine_ema, 2) : "-", "num");
    const ban = peer.trust && peer.trust.banned;
    cell(row, ban ? `round ${ban.round}: ${ban.reason}` : "no", ban ? "banned" : "");
    cell(row, `${fixed(peer.last_seen_seconds, 0)} s ago`, "num");
    body.appendChild(row);
  }
}

function fillContribution(node, run) {
  const list = document.getElementById("contribution");
  list.replaceChildren();
  const add = (term, value) => {
    const dt = document.createElement("dt"); dt.textContent = term;
    const dd = document.createElement("dd"); dd.textContent = value;
    list.append(dt, dd);
  };
  if (!node) { add("node", "no node to show (give --node or --status-file)"); return; }
  if (node.error) { add("node", node.error); return; }
  const mine = run.peers.find((p) => p.peer_id === node.peer_id);
  const outcomes = Object.entries(node.outcomes || {}).map(([k, v]) => `${k} ${v}`).join(", ");
  add("node", node.peer_id);
  add("epoch", String(node.epoch));
  add("samples trained", String(node.samples));
  add("share of the run's throughput",
      mine && run.samples_per_second ? `${fixed(100 * mine.throughput / run.samples_per_second, 0)}%` : "-");
  add("share of a round's parts", mine ? `${fixed(100 * mine.share, 0)}%` : "-");
  add("rounds", outcomes || "none yet");
  add("sent / received", `${bytes(node.bytes_sent)} / ${bytes(node.bytes_received)}`);
  add("validation loss", `${fixed(node.val_loss, 3)} (from ${fixed(node.initial_val_loss, 3)})`);
}

function draw(run) {
  text("run", run.run);
  const when = run.read_at ? new Date(run.read_at * 1000).toLocaleTimeString() : "never";
  text("summary", `${run.peers.length} peer(s), ${fixed(run.samples_per_second, 1)} samples/s; read at ${when}` +
       (run.not_on_allowlist ? `; ${run.not_on_allowlist} record(s) not on the allowlist` : ""));
  const problem = document.getElementById("problem");
  problem.hidden = !run.error;
  problem.textContent = run.error ? `the last read failed: ${run.error}` : "";
  const warnings = document.getElementById("warnings");
  warnings.replaceChildren(...run.warnings.map((w) => {
    const item = document.createElement("li"); item.textContent = w; return item;
  }));
  const node = run.node && !run.node.error ? run.node : null;
  document.body.dataset.lossPoints = String(drawLoss(node));
  document.body.dataset.rounds = String(drawRounds(node));
  document.body.dataset.peers = String(drawPeers(run.peers));
  fillPeers(run.peers);
  fillContribution(run.node, run);
  document.body.dataset.reads = String(run.reads);
}

async function refresh() {
  try {
    const answer = await fetch("api/run", { cache: "no-store" });
    if (!answer.ok) throw new Error(`the server answered ${answer.status}`);
    draw(await answer.json());
  } catch (error) {
    const problem = document.getElementById("problem");
    problem.hidden = false;
    problem.textContent = `cannot reach the run page's server: ${error.message}`;
  } finally {
    setTimeout(refresh, REFRESH_MS);
  }
}

refresh();
