// tpkit quiz: SVG drawings. Charts draw what a live demonstration computed (kinds:
// bars, grid, matrices, sums; specs from tpkit/quiz/live_charts.py), with every number
// as a label; diagrams illustrate an answer, in Megatron's notation, at the chosen tp.
// Titles go in an HTML <figcaption> (it wraps); the SVGs scale to the width available.
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
const DW = 420;  // the diagrams' viewBox width
let W = 420;  // a chart's viewBox width: the width it gets on screen, so text keeps its size

function chartWidth() {
  const main = document.querySelector("main");
  return Math.round(Math.max(280, Math.min(560, (main ? main.clientWidth : 420) - 80)));
}

function sv(tag, attrs = {}, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
const box = (x, y, w, h, cls) => sv("rect", { x, y, width: w, height: h, rx: 2, class: cls });
const label = (x, y, s, cls = "", anchor = "middle") =>
  sv("text", { x, y, "text-anchor": anchor, class: cls }, s);
const line = (x1, y1, x2, y2, cls = "link") => sv("line", { x1, y1, x2, y2, class: cls });

function figure(kind, caption, height, parts) {
  const svg = sv("svg", { viewBox: `0 0 ${W} ${height}`, role: "img", class: `chart chart-${kind}`,
                          "aria-label": caption });
  svg.append(...parts);
  const fig = document.createElement("figure");
  const cap = document.createElement("figcaption");
  cap.textContent = caption;
  fig.append(cap, svg);
  return fig;
}

// ---- charts of the live demonstrations ------------------------------------------------
function barsChart(c) {
  const max = Math.max(...c.bars.map((b) => Math.max(b.value, b.ref || 0)), 1e-12);
  const span = W - 120, parts = [];
  c.bars.forEach((b, i) => {
    const y = 4 + i * 34, len = Math.max(1, (b.value / max) * span);
    const ref = b.ref === undefined ? 0 : 2 + (b.ref / max) * span;
    parts.push(label(2, y + 10, b.label, "small", "start"), box(2, y + 14, len, 14, b.color),
               label(Math.max(len, ref) + 6, y + 25, b.text, "value", "start"));
    if (ref) parts.push(line(ref, y + 11, ref, y + 31, "ref"));
  });
  const cap = c.ref_label ? `${c.title} (| = ${c.ref_label})` : c.title;
  return figure("bars", cap, 8 + c.bars.length * 34, parts);
}

function gridChart(c) {
  const n = Math.max(...c.rows.map((r) => r.cells.length));
  const cw = Math.min(96, (W - 8) / n), parts = [];
  c.rows.forEach((r, i) => {
    const y = 4 + i * 62;
    parts.push(label(4, y + 10, r.label, "small", "start"));
    r.cells.forEach((cell, k) => {
      const x = 4 + k * cw;
      parts.push(box(x + 1, y + 16, cw - 2, 24, cell.color),
                 label(x + cw / 2, y + 32, cell.text, cw < 40 ? "tiny" : "cell"));
    });
    for (let k = 0; c.per_node > 0 && k < r.cells.length; k += c.per_node) {
      const x = 4 + k * cw, w = Math.min(c.per_node, r.cells.length - k) * cw;
      parts.push(box(x - 1, y + 13, w + 2, 30, "node"),
                 label(x + w / 2, y + 54, `${c.node} ${k / c.per_node}`, "small"));
    }
  });
  return figure("grid", c.title, 8 + c.rows.length * 62, parts);
}

function matricesChart(c) {
  const slot = W / c.mats.length, parts = [];
  c.mats.forEach((m, i) => {
    const [r, k] = m.shape, scale = Math.min((slot - 30) / k, 110 / r);
    const w = k * scale, h = r * scale, x0 = i * slot + (slot - w) / 2, y0 = 6;
    for (let p = 0; p < m.parts; p++) {
      const cols = m.split === "cols";
      const x = cols ? x0 + (p * w) / m.parts : x0, y = cols ? y0 : y0 + (p * h) / m.parts;
      const pw = cols ? w / m.parts : w, ph = cols ? h : h / m.parts;
      parts.push(box(x, y, pw, ph, `g${p % 4}`), label(x + pw / 2, y + ph / 2 + 4, `${m.label}${p + 1}`));
    }
    parts.push(label(x0 + w / 2, y0 + h + 16, `${m.label} [${r}, ${k}]`, "small"));
  });
  return figure("matrices", c.title, 140, parts);
}

function sumsChart(c) {
  const rows = [...c.terms.map((t, i) => [i ? "+" : "", t]), ["=", c.result]];
  if (c.check) rows.push(["vs", c.check]);
  const n = c.result.values.length, cw = (W - 110) / n, parts = [];
  rows.forEach(([op, t], i) => {
    const y = 4 + i * 26 + (op === "=" ? 6 : 0) + (op === "vs" ? 10 : 0);
    if (op === "=") parts.push(line(20, y - 4, W - 2, y - 4));
    parts.push(label(10, y + 15, op, "op"), label(24, y + 15, t.label, "small", "start"));
    t.values.forEach((v, k) => {
      const x = 108 + k * cw;
      parts.push(box(x, y + 2, cw - 4, 20, t.color),
                 label(x + cw / 2 - 2, y + 16, v.toFixed(4), cw < 64 ? "tiny" : "cell"));
    });
  });
  return figure("sums", c.title, 30 + rows.length * 26, parts);
}

const CHARTS = { bars: barsChart, grid: gridChart, matrices: matricesChart, sums: sumsChart };

function chart(spec) {
  W = chartWidth();
  return (CHARTS[spec.kind] || (() => document.createElement("span")))(spec);
}

// ---- diagrams of the answers (level 1), drawn at the chosen tp --------------------------
function slices(x, y, w, h, tp, name, byCols) {
  const out = [];
  for (let p = 0; p < tp; p++) {
    const px = byCols ? x + (p * w) / tp : x, py = byCols ? y : y + (p * h) / tp;
    const pw = byCols ? w / tp : w, ph = byCols ? h : h / tp;
    out.push(box(px, py, pw, ph, `g${p}`), label(px + pw / 2, py + ph / 2 + 4, `${name}${p + 1}`));
  }
  return out;
}

const DIAGRAMS = {
  split: (ui, tp) => [box(10, 8, 400, 22, "muted"), label(210, 23, `${ui.layer} n−1`),
    ...slices(10, 38, 400, 46, tp, "W", true),
    box(10, 92, 400, 22, "muted"), label(210, 107, `${ui.layer} n+1`)],
  mlp: (ui, tp) => [box(4, 50, 30, 40, "box"), label(19, 74, "X"), label(48, 44, "f", "op"),
    line(34, 70, 60, 70), ...slices(60, 40, 90, 60, tp, "A", true), label(105, 34, "A = [A1 | …]", "small"),
    line(150, 70, 166, 70), label(188, 74, "GeLU", "small"), line(210, 70, 224, 70),
    ...slices(224, 40, 80, 60, tp, "B", false), label(264, 34, "B = [B1 ; …]", "small"),
    line(304, 70, 330, 70), label(318, 62, "g", "op"), sv("circle", { cx: 346, cy: 70, r: 14, class: "comm" }),
    label(346, 75, "Σ"), line(360, 70, 380, 70), box(380, 55, 34, 30, "box"), label(397, 75, "Z")],
  node: (ui, tp) => [box(4, 10, 200, 92, "box"), box(216, 10, 200, 92, "box"),
    label(104, 96, `${ui.node} 0`, "small"), label(316, 96, `${ui.node} 1`, "small"),
    ...[...Array(8).keys()].flatMap((g) => [box(12 + 24 * g, 30, 20, 20, g < tp ? "g0" : "muted"),
      box(224 + 24 * g, 30, 20, 20, "muted")]),
    line(12, 62, 8 + 24 * tp, 62, "fast"), label(104, 80, `NVLink: tp = ${tp}`, "small"),
    line(204, 40, 216, 40, "slow"), label(210, 124, ui.network, "small")],
  heads: (ui, tp) => [...[...Array(8).keys()].flatMap((h) => [
      box(8 + 51 * h, 20, 46, 36, `g${Math.floor(h / (8 / tp))}`), label(31 + 51 * h, 42, `${ui.head} ${h}`, "tiny")])],
  allreduce: (ui, tp) => [...[...Array(tp).keys()].flatMap((p) => [
      box(8, 8 + p * 30, 100, 24, `g${p}`), label(58, 24 + p * 30, `GPU ${p}: Y${p + 1}B${p + 1}`, "tiny"),
      line(108, 20 + p * 30, 180, 70)]), sv("circle", { cx: 196, cy: 70, r: 16, class: "comm" }),
    label(196, 75, "Σ"), line(212, 70, 260, 70), box(260, 55, 150, 30, "box"),
    label(335, 75, "Z = Y1B1 + …  (×tp)", "tiny")],
  grid: (ui, tp) => [...[0, 1].flatMap((p) => [box(8 + p * 206, 20, 200, 50, "node"),
      label(108 + p * 206, 86, `${ui.node} ${p}: pp${p}`, "small"),
      ...[...Array(tp).keys()].map((t) => box(16 + p * 206 + t * (184 / tp), 30, 184 / tp - 6, 30, `g${t}`))])],
  rows: (ui, tp) => [...[...Array(tp).keys()].flatMap((p) => [
      box(6 + p * (300 / tp), 30, 300 / tp - 22, 40, `g${p}`),
      label(6 + p * (300 / tp) + (300 / tp - 22) / 2, 55, `Y${p + 1}B${p + 1}`),
      label(6 + (p + 1) * (300 / tp) - 11, 55, p < tp - 1 ? "+" : "=", "op")]),
    box(312, 30, 100, 40, "box"), label(362, 55, "Z")],
  latency: (ui) => [label(36, 35, "NVLink", "small"), label(36, 85, ui.network, "small"),
    ...[0, 1, 2, 3].flatMap((k) => [box(76 + 52 * k, 22, 40, 20, "g0"), box(116 + 52 * k, 22, 8, 20, "comm"),
      box(76 + 80 * k, 72, 40, 20, "g0"), box(116 + 80 * k, 72, 36, 20, "comm")]),
    box(76, 108, 10, 10, "g0"), label(90, 117, ui.compute, "small", "start"),
    box(200, 108, 10, 10, "comm"), label(214, 117, `all-reduce ×4 / ${ui.layer}`, "small", "start")],
};

const CAPTIONS = {  // under the drawing, in HTML so that it wraps on a phone
  split: () => "XW = [XW1 | XW2 | …]: GPU i holds Wi",
  mlp: (ui) => `Y = GeLU(XA) = [Y1 | Y2 | …], Z = YB = Y1B1 + Y2B2 + … · ${ui.fg_legend}`,
  heads: () => "Q, K, V: [W1 | W2 | …] → softmax(QKᵀ)V → out: [O1 ; O2 ; …] → g (Σ)",
  grid: (ui) => ui.grid_legend,
  rows: () => "Z = YB = Y1B1 + Y2B2 + … — g: all-reduce (Σ)",
};

const HEIGHTS = { split: 120, mlp: 108, node: 130, heads: 62, allreduce: 128, grid: 96, rows: 80,
                  latency: 124 };

function diagram(key, ui, tp) {
  const make = DIAGRAMS[key];
  if (!make) return null;
  const svg = sv("svg", { viewBox: `0 0 ${DW} ${HEIGHTS[key]}`, role: "img", "aria-label": key,
                          class: `diagram diagram-${key}` });
  svg.append(...make(ui, tp));
  const fig = document.createElement("figure");
  fig.append(svg);
  if (CAPTIONS[key]) {
    const cap = document.createElement("figcaption");
    cap.textContent = CAPTIONS[key](ui);
    fig.append(cap);
  }
  return fig;
}

window.tpkitCharts = { chart, diagram };
