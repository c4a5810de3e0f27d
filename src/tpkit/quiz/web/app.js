// tpkit quiz in the browser: answers and explanations appear as you answer.
// Content comes from /api/quiz (questions.json); text goes in with textContent only.
"use strict";

const state = { data: null, lang: "en", answers: {}, live: {}, tp: 2 };
const $ = (sel) => document.querySelector(sel);
const SVGNS = "http://www.w3.org/2000/svg";

function el(tag, attrs = {}, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  for (const kid of kids) e.append(kid);
  return e;
}

// ---- diagrams: small inline SVGs, one per question ---------------------------------
function sv(tag, attrs = {}, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
const rect = (x, y, w, h, cls) => sv("rect", { x, y, width: w, height: h, rx: 3, class: cls });
const txt = (x, y, s, cls = "") => sv("text", { x, y, "text-anchor": "middle", class: cls }, s);
const line = (x1, y1, x2, y2, cls = "link") => sv("line", { x1, y1, x2, y2, class: cls });

const DIAGRAMS = {
  split: (ui) => [  // one layer's W split by columns; the layers around it stay whole
    rect(10, 10, 280, 22, "muted"), txt(150, 25, `${ui.layer} n−1`),
    rect(10, 40, 140, 50, "g0"), rect(150, 40, 140, 50, "g1"),
    txt(80, 70, "W[:, :h/2] → GPU 0"), txt(220, 70, "W[:, h/2:] → GPU 1"),
    rect(10, 98, 280, 22, "muted"), txt(150, 113, `${ui.layer} n+1`)],
  mlp: (ui) => [  // X -> [A1 | A2] -> GeLU -> [B1 ; B2] -> all-reduce -> Y
    rect(5, 45, 30, 40, "box"), txt(20, 70, "X"), line(35, 65, 50, 65),
    rect(50, 35, 30, 60, "g0"), rect(80, 35, 30, 60, "g1"), txt(65, 70, "A₁"), txt(95, 70, "A₂"),
    txt(80, 28, ui.a_columns, "small"), line(110, 65, 125, 65), txt(145, 69, "GeLU"),
    line(165, 65, 180, 65), rect(180, 35, 60, 30, "g0"), rect(180, 65, 60, 30, "g1"),
    txt(210, 54, "B₁"), txt(210, 84, "B₂"), txt(210, 28, ui.b_rows, "small"),
    line(240, 65, 255, 65), rect(255, 50, 40, 30, "comm"), txt(275, 69, "Σ"),
    txt(275, 110, "1 all-reduce", "small")],
  node: (ui) => [  // tp group on NVLink inside node 0; the network between nodes
    rect(5, 10, 135, 100, "box"), rect(160, 10, 135, 100, "box"),
    txt(72, 102, `${ui.node} 0`, "small"), txt(227, 102, `${ui.node} 1`, "small"),
    line(30, 45, 115, 45, "fast"), txt(72, 80, "NVLink", "small"),
    ...[0, 1, 2, 3].flatMap((g) => [rect(15 + 30 * g, 33, 24, 24, `g${g}`),
      rect(170 + 30 * g, 33, 24, 24, "muted")]),
    line(140, 60, 160, 60, "slow"), txt(150, 128, ui.network, "small")],
  heads: (ui) => [  // heads 0,1 on GPU 0, heads 2,3 on GPU 1; out projection all-reduces
    ...[0, 1, 2, 3].flatMap((h) => [rect(10 + 55 * h, 20, 48, 40, `g${h >> 1}`),
      txt(34 + 55 * h, 44, `${ui.head} ${h}`)]),
    txt(62, 14, "GPU 0", "small"), txt(172, 14, "GPU 1", "small"),
    line(62, 60, 240, 103), line(172, 60, 240, 103), rect(240, 90, 55, 26, "comm"),
    txt(267, 107, "Σ"), txt(150, 125, ui.qkv_split, "small")],
  allreduce: () => [  // partial sums in, the same full sum out on every rank
    rect(10, 15, 70, 30, "g0"), txt(45, 35, "GPU 0: Y₁"), rect(10, 75, 70, 30, "g1"),
    txt(45, 95, "GPU 1: Y₂"), line(80, 30, 130, 60), line(80, 90, 130, 60),
    sv("circle", { cx: 145, cy: 60, r: 15, class: "comm" }), txt(145, 64, "Σ"),
    line(160, 60, 210, 30), line(160, 60, 210, 90), rect(210, 15, 85, 30, "g0"),
    txt(252, 35, "Y = Y₁ + Y₂"), rect(210, 75, 85, 30, "g1"), txt(252, 95, "Y = Y₁ + Y₂")],
  grid: (ui) => [  // 8 ranks as dp x pp x tp, tp innermost
    ...[0, 1].flatMap((d) => [0, 1].flatMap((p) => [0, 1].flatMap((t) => {
      const r = (d * 2 + p) * 2 + t, x = 40 + p * 120 + t * 50, y = 20 + d * 50;
      return [rect(x, y, 44, 36, `g${p * 2 + t}`), txt(x + 22, y + 22, `${ui.rank} ${r}`)];
    }))),
    txt(20, 42, "dp0", "small"), txt(20, 92, "dp1", "small"),
    txt(87, 15, "pp0  (tp →)", "small"), txt(207, 15, "pp1  (tp →)", "small")],
  rows: () => [  // Y1·B1 + Y2·B2 = Y
    rect(10, 30, 70, 50, "g0"), txt(45, 60, "Y₁·B₁"), txt(95, 60, "+"),
    rect(110, 30, 70, 50, "g1"), txt(145, 60, "Y₂·B₂"), txt(195, 60, "="),
    rect(210, 30, 80, 50, "box"), txt(250, 60, "Y"), txt(150, 105, "all-reduce (Σ)", "small")],
  latency: (ui) => [  // compute blocks interleaved with collectives: NVLink vs network
    txt(30, 35, "NVLink", "small"), txt(30, 85, ui.network, "small"),
    ...[0, 1, 2, 3].flatMap((k) => [rect(60 + 38 * k, 22, 30, 20, "g0"),  // same compute,
      rect(90 + 38 * k, 22, 6, 20, "comm"), rect(60 + 58 * k, 72, 30, 20, "g0"),  // slower
      rect(90 + 58 * k, 72, 28, 20, "comm")]),  // collectives: the step takes longer
    rect(60, 108, 10, 10, "g0"), sv("text", { x: 74, y: 117, class: "small" }, ui.compute),
    rect(140, 108, 10, 10, "comm"),
    sv("text", { x: 154, y: 117, class: "small" }, `all-reduce ×4 / ${ui.layer}`)],
};

function diagram(key) {
  const make = DIAGRAMS[key];
  if (!make) return el("span");
  const svg = sv("svg", { viewBox: "0 0 300 130", role: "img", "aria-label": key,
                          class: `diagram diagram-${key}` });
  svg.append(...make(state.data.ui[state.lang]));
  return el("figure", {}, svg);
}

// ---- questions ------------------------------------------------------------------
function renderQuestion(q, i) {
  const t = q[state.lang], ui = state.data.ui[state.lang], total = state.data.questions.length;
  const chosen = state.answers[i];
  const sec = el("section", { class: "question", id: `q${i + 1}`, "data-number": i + 1 },
    el("h2", {}, `${ui.question} ${i + 1}/${total}`), el("p", { class: "text" }, t.question),
    diagram(q.diagram));
  const list = el("ol", { class: "options" });
  t.options.forEach((opt, k) => {
    const b = el("button", { type: "button", class: "option", "data-index": k },
      el("span", { class: "num" }, `${k + 1}.`), opt);
    if (chosen !== undefined) {
      b.disabled = true;
      if (k === q.answer) b.classList.add("right");
      else if (k === chosen) b.classList.add("wrong");
    } else {
      b.addEventListener("click", () => answer(i, k));
    }
    list.append(el("li", {}, b));
  });
  sec.append(list);
  if (chosen !== undefined) sec.append(feedback(q, i, chosen === q.answer, t, ui));
  return sec;
}

function feedback(q, i, ok, t, ui) {
  const box = el("div", { class: "feedback" },
    el("p", { class: `verdict ${ok ? "right" : "wrong"}` }, ok ? ui.right : ui.wrong),
    el("p", { class: "correct" }, `${ui.correct_answer} ${q.answer + 1}. ${t.options[q.answer]}`),
    el("p", { class: "explanation" }, `${ui.explanation} ${t.explanation}`));
  if (state.data.live) box.append(liveBox(i, ui));
  return box;
}

function liveBox(i, ui) {
  const key = `${i + 1}:${state.tp}:${state.lang}`, box = el("div", { class: "live" });
  const out = state.live[key];
  if (out) {
    box.append(el("pre", {}, out));
    return box;
  }
  const b = el("button", { type: "button" }, ui.show_live.replace("{tp}", state.tp));
  b.addEventListener("click", async () => {
    b.disabled = true;
    b.textContent = ui.running;
    try {
      const r = await fetch(`/api/live/${i + 1}?tp=${state.tp}&lang=${state.lang}`);
      const body = await r.json();
      state.live[key] = r.ok ? body.text : `error: ${body.error}`;
    } catch (e) {
      state.live[key] = `error: ${e}`;
    }
    refresh(i);
  });
  box.append(b);
  return box;
}

function answer(i, k) {
  if (state.answers[i] !== undefined) return;
  state.answers[i] = k;
  refresh(i);
}

function refresh(i) {
  const old = document.getElementById(`q${i + 1}`);
  old.replaceWith(renderQuestion(state.data.questions[i], i));
  renderScore();
}

function renderScore() {
  const ui = state.data.ui[state.lang], qs = state.data.questions, total = qs.length;
  const done = Object.keys(state.answers).length;
  const right = qs.filter((q, i) => state.answers[i] === q.answer).length;
  $("#score").textContent = `${ui.score} ${right}/${total} · ${done}/${total} ${ui.answered}`;
  $("#final").hidden = done < total;
  $("#final").textContent = done < total ? "" :
    `${ui.score} ${right}/${total}. ${ui.final.replace("{score}", right).replace("{total}", total)}`;
}

function render() {
  const d = state.data, ui = d.ui[state.lang];
  document.documentElement.lang = state.lang;
  document.title = d.title[state.lang];
  $("#title").textContent = d.title[state.lang];
  $("#intro").textContent = d.intro[state.lang];
  $("#restart").textContent = ui.restart;
  for (const b of document.querySelectorAll("#langs button")) {
    b.setAttribute("aria-pressed", String(b.dataset.lang === state.lang));
  }
  $("#questions").replaceChildren(...d.questions.map(renderQuestion));
  renderScore();
}

function setLang(lang) {
  if (!state.data.languages.includes(lang)) return;
  state.lang = lang;
  const url = new URL(location.href);
  url.searchParams.set("lang", lang);
  history.replaceState(null, "", url);
  render();
}

async function main() {
  const r = await fetch("/api/quiz");
  state.data = await r.json();
  const asked = new URL(location.href).searchParams.get("lang");
  state.lang = state.data.languages.includes(asked) ? asked : state.data.default_lang;
  for (const b of document.querySelectorAll("#langs button")) {
    b.addEventListener("click", () => setLang(b.dataset.lang));
  }
  if (state.data.live) {
    const sel = $("#tp");
    for (const tp of state.data.live_tp) sel.append(el("option", { value: tp }, `${tp}`));
    sel.addEventListener("change", () => { state.tp = Number(sel.value); render(); });
    $("#tp-choice").hidden = false;
  }
  $("#restart").addEventListener("click", () => { state.answers = {}; render(); });
  render();
}

main();
