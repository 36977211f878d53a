"use strict";
// The token comes in the page's URL (`shoal dashboard` prints it) and goes on every request as a header.
const token = new URLSearchParams(location.search).get("token") || "";
const $ = (id) => document.getElementById(id);
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs = {}, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.setAttribute("class", v); else if (k === "text") node.textContent = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
}
const short = (id) => (id && id.length > 16 ? id.slice(0, 8) + "…" + id.slice(-6) : id || "");
const gib = (n) => (n / 2 ** 30).toFixed(1) + " GiB";
const mb = (n) => (n / 1e6).toFixed(2) + " MB";
const secs = (s) => (s < 90 ? s.toFixed(0) + " s" : s < 5400 ? (s / 60).toFixed(0) + " min" : (s / 3600).toFixed(1) + " h");

function row(cells) {
  const tr = el("tr");
  for (const c of cells) tr.append(typeof c === "object" ? c : el("td", {text: String(c)}));
  return tr;
}

function renderNode(n) {
  $("node-id").textContent = short(n.peer_id);
  const hw = n.hardware || {};
  const benches = (hw.benchmarks || []).filter((b) => !b.error).map((b) => b.tflops);
  const facts = [
    ["version", n.version], ["up", secs(n.uptime_s || 0)],
    ["peers", `${n.peers.alive || 0} alive, ${n.peers.suspect || 0} suspect, ${n.peers.dead || 0} dead`],
    ["hardware", `${(hw.cpu || {}).usable_cores || "?"} cores, ${gib((hw.ram || {}).total_bytes || 0)}` +
      (benches.length ? `, ${Math.max(...benches).toPrecision(3)} TFLOP/s` : "")],
    ["reachability", n.reachability ? `${n.reachability.status} (${n.reachability.reason})` : "-"],
    ["traffic", `${mb(n.bytes.sent)} out, ${mb(n.bytes.received)} in` +
      (n.wire_bytes ? `; on the wire ${mb(n.wire_bytes.sent)} out, ${mb(n.wire_bytes.received)} in` : "")],
  ];
  $("node-facts").replaceChildren(el("div", {class: "facts"}, ...facts.map(([k, v]) => el("span", {}, el("b", {text: k}), String(v)))));
  const sc = n.shardcast;
  const shards = $("shards");
  if (!sc) { shards.replaceChildren(el("p", {class: "muted", text: "SHARDCAST is not running"})); return; }
  const rejected = Object.entries(sc.shards_rejected || {}).map(([k, v]) => `${k}: ${v}`).join(", ") || "none";
  shards.replaceChildren(el("div", {class: "facts"},
    ...[["manifests held", sc.manifests], ["shards served", sc.shards_served], ["served", mb(sc.bytes_served)],
        ["shards fetched", sc.shards_fetched], ["fetched", mb(sc.bytes_fetched)], ["rejected", rejected]]
      .map(([k, v]) => el("span", {}, el("b", {text: k}), String(v)))));
  const fetches = sc.fetches || [];
  if (fetches.length) {
    const table = el("table", {}, el("thead", {}, row(["fetch", "state", "progress", "rate", "sources", "seconds"].map((h) => el("th", {text: h})))));
    const tb = el("tbody");
    for (const f of [...fetches].reverse()) {
      const pct = f.bytes_total ? (100 * f.bytes_done / f.bytes_total).toFixed(0) + "%" : "-";
      tb.append(row([el("td", {class: "mono", text: f.manifest_id.slice(0, 12)}), f.state + (f.error ? ": " + f.error : ""),
        `${pct} of ${mb(f.bytes_total)}`, (f.bytes_per_s / 1e6).toFixed(1) + " MB/s", f.num_sources, f.seconds.toFixed(1)]));
    }
    table.append(tb);
    shards.append(table);
  }
}

function renderPeers(peers) {
  const body = $("peers").tBodies[0];
  body.replaceChildren(...peers.map((p) => {
    const hw = p.hardware;
    return row([el("td", {class: "mono", text: short(p.peer_id), title: p.peer_id}),
      el("td", {class: p.state, text: p.state + (p.connected ? (p.path === "relayed" ? " (via a relay)" : "") : " (not connected)")}),
      `${hw.devices.join(", ") || "-"}; ${gib(hw.memory_bytes)}`, hw.tflops > 0 ? hw.tflops.toPrecision(3) : "not measured",
      el("td", {class: "mono", text: (p.addrs.length ? p.addrs[0].split("/p2p/")[0] : "-") + (p.behind_nat ? " (behind NAT: relayed addresses)" : "")}),
      p.score.toFixed(0), p.last_seen_s.toFixed(1) + " s ago", p.status || ""]);
  }));
  $("no-peers").hidden = peers.length > 0;
  $("peers").hidden = peers.length === 0;
}

function curve(points) {
  const W = 560, H = 220, L = 48, R = 12, T = 12, B = 28;
  const svg = el("svg:svg", {class: "curve", viewBox: `0 0 ${W} ${H}`, "data-points": String(points.length)});
  svg.append(el("svg:line", {class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B}),
             el("svg:line", {class: "axis", x1: L, y1: T, x2: L, y2: H - B}));
  if (!points.length) { svg.append(el("svg:text", {x: L + 10, y: H / 2, text: "no closed round yet"})); return svg; }
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs, Math.min(...xs) + 1)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (y1 - y0 < 1e-6) { y0 -= 0.5; y1 += 0.5; }
  const px = (x) => L + (x - x0) / (x1 - x0) * (W - L - R), py = (y) => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  svg.append(el("svg:polyline", {class: "line", points: points.map((p) => `${px(p[0])},${py(p[1])}`).join(" ")}));
  for (const p of points) svg.append(el("svg:circle", {class: "dot", cx: px(p[0]), cy: py(p[1]), r: 3}));
  svg.append(el("svg:text", {x: 4, y: T + 8, text: y1.toFixed(3)}), el("svg:text", {x: 4, y: H - B, text: y0.toFixed(3)}),
             el("svg:text", {x: L, y: H - 8, text: `round ${x0}`}), el("svg:text", {x: W - R - 60, y: H - 8, text: `round ${x1}`}),
             el("svg:text", {x: W / 2 - 50, y: H - 8, text: "held-out loss"}));
  return svg;
}

function renderTask(t) {
  const card = el("div", {class: "task", "data-task": t.id});
  // Over closed rounds only: the round in progress has training time but no round time yet.
  const closed = t.agreement || [], trainS = closed.reduce((a, r) => a + r.train_s, 0), roundS = closed.reduce((a, r) => a + r.round_s, 0);
  const share = roundS ? (100 * trainS / roundS).toFixed(0) + "%" : "-";
  const rejected = Object.entries(t.dropped || {}).map(([k, v]) => `${k}: ${v}`).join(", ") || "none";
  card.append(el("h3", {}, `${t.name} `, el("span", {class: "mono muted", text: t.id.slice(0, 12)})));
  const facts = t.decision !== "joined" ? [[t.decision, t.reason]] : [
    ["phase", t.phase + (t.detail ? ` (${t.detail})` : "")], ["round", `${t.round ?? "-"} / ${t.rounds}`],
    ["eval loss", t.eval_loss == null ? "-" : t.eval_loss.toFixed(4)], ["members", (t.members || []).length],
    ["training share (this node)", share], ["bytes", `${mb(t.bytes.sent)} out, ${mb(t.bytes.received)} in`],
    ["rejections", rejected]];
  card.append(el("div", {class: "facts"}, ...facts.map(([k, v]) => el("span", {}, el("b", {text: k}), String(v)))));
  if (t.decision !== "joined") return card;
  const nodes = el("table", {class: "nodes"}, el("thead", {}, row(["node", "member", "round", "eval loss", "training share"]
    .map((h) => el("th", {text: h})))));
  const nb = el("tbody");
  for (const p of t.peers || []) {
    nb.append(row([el("td", {class: "mono", text: short(p.peer_id) + (p.self ? " (this node)" : ""), title: p.peer_id}),
      p.member ? "yes" : "no", p.round ?? "-", p.eval_loss == null ? "-" : p.eval_loss.toFixed(4),
      el("td", {class: "share", text: p.train_share == null ? "-" : (100 * p.train_share).toFixed(0) + "%"})]));
  }
  nodes.append(nb);
  const rounds = el("table", {class: "rounds"}, el("thead", {}, row(["round", "agreed", "peers agreeing", "members", "eval loss", "train s", "round s", "weights"]
    .map((h) => el("th", {text: h})))));
  const tb = el("tbody");
  for (const a of [...(t.agreement || [])].reverse()) {
    tb.append(row([a.round, el("td", {class: a.agreed ? "yes" : "no", text: a.caught_up ? "caught up" : a.agreed ? "yes" : "no"}),
      a.peers_agreeing ?? "-", a.members, a.eval_loss == null ? "-" : a.eval_loss.toFixed(4), a.train_s.toFixed(1), a.round_s.toFixed(1),
      el("td", {class: "mono", text: a.weights_hash.slice(0, 10)})]));
  }
  rounds.append(tb);
  card.append(el("div", {class: "cols"}, curve(t.eval_losses || []), el("div", {class: "scroll"}, rounds)), nodes);
  return card;
}

function render(snap) {
  renderNode(snap.node);
  renderPeers(snap.peers);
  $("tasks").replaceChildren(...(snap.tasks.length ? snap.tasks.map(renderTask) : [el("p", {class: "muted", text: "no tasks"})]));
  $("live").textContent = "live · " + new Date().toLocaleTimeString();
  $("live").className = "ok";
}

async function follow() {
  // EventSource cannot send a header, so the stream is read through fetch.
  for (;;) {
    try {
      const resp = await fetch("/events", {headers: {Authorization: "Bearer " + token}, cache: "no-store"});
      if (resp.status === 401) { $("live").textContent = "wrong or missing token: open the URL `shoal dashboard` prints"; $("live").className = "stale"; return; }
      const reader = resp.body.getReader(), decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buf += decoder.decode(value, {stream: true});
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const chunk = buf.slice(0, cut); buf = buf.slice(cut + 2);
          const data = chunk.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
          if (data) render(JSON.parse(data));
        }
      }
    } catch (e) { /* the node restarted or went away: retry below */ }
    $("live").textContent = "reconnecting…"; $("live").className = "stale";
    await new Promise((r) => setTimeout(r, 2000));
  }
}
follow();
