// tpkit quiz in the browser: answers and explanations appear as you answer.
// Questions come from /api/quiz without their answers; each answer is checked by
// POST /api/answer, which returns the verdict and the explanation. Options are shown
// in a seeded random order (?seed=N repeats it); text goes in with textContent only.
"use strict";

const state = { data: null, lang: "en", level: "1", tp: 2, seed: 0, answers: { 1: {}, 2: {} },
                live: {} };
const $ = (sel) => document.querySelector(sel);
const drawings = window.tpkitCharts;

function el(tag, attrs = {}, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  for (const kid of kids) if (kid !== null) e.append(kid);
  return e;
}

function order(number) {  // the seed's option indices in display order (mulberry32 + Fisher-Yates)
  let a = (state.seed * 1000003 + Number(state.level) * 101 + number) >>> 0;
  const rand = () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const out = [0, 1, 2, 3];
  for (let i = out.length - 1; i > 0; i--) {
    const j = Math.floor(rand() * (i + 1));
    [out[i], out[j]] = [out[j], out[i]];
  }
  return out;
}

const ui = () => state.data.ui[state.lang];
const questions = () => state.data.levels[state.level];
const answers = () => state.answers[state.level];

// ---- one question ---------------------------------------------------------------------
function renderQuestion(q) {
  const t = q[state.lang], u = ui(), total = questions().length, done = answers()[q.number];
  const sec = el("section", { class: "question", id: `q${q.number}`, "data-number": q.number },
    el("h2", {}, `${u.question} ${q.number}/${total}`), el("p", { class: "text" }, t.question));
  const list = el("ol", { class: "options" });
  order(q.number).forEach((seedIndex, k) => {
    const b = el("button", { type: "button", class: "option", "data-index": seedIndex },
      el("span", { class: "num" }, `${k + 1}.`), t.options[seedIndex]);
    if (done) {
      b.disabled = true;
      if (seedIndex === done.answer) b.classList.add("right");
      else if (seedIndex === done.choice) b.classList.add("wrong");
    } else {
      b.addEventListener("click", () => answer(q, seedIndex));
    }
    list.append(el("li", {}, b));
  });
  sec.append(list);
  if (done) sec.append(feedback(q, done, t, u));
  return sec;
}

function feedback(q, done, t, u) {
  const box = el("div", { class: "feedback" },
    el("p", { class: `verdict ${done.right ? "right" : "wrong"}` }, done.right ? u.right : u.wrong),
    el("p", { class: "correct" }, `${u.correct_answer} ${t.options[done.answer]}`),
    el("p", { class: "explanation" }, `${u.explanation} ${done.explanation[state.lang]}`),
    state.level === "1" ? drawings.diagram(q.diagram, u, state.tp) : null);
  if (state.data.live) box.append(liveBox(q, u));
  return box;
}

function liveBox(q, u) {
  const key = `${state.level}:${q.number}:${state.tp}:${state.lang}`;
  const box = el("div", { class: "live" }), out = state.live[key];
  if (out && out.error) {
    box.append(el("p", { class: "error" }, out.error));
  } else if (out) {
    box.append(el("h3", {}, u.live), ...out.charts.map(drawings.chart),
               el("details", {}, el("summary", {}, u.details), el("pre", {}, out.text)));
  } else {
    const b = el("button", { type: "button" }, u.show_live.replace("{tp}", state.tp));
    b.addEventListener("click", async () => {
      b.disabled = true;
      b.textContent = u.running;
      try {
        const r = await fetch(`/api/live/${q.number}?tp=${state.tp}&lang=${state.lang}` +
                              `&level=${state.level}`);
        const body = await r.json();
        state.live[key] = r.ok ? body : { error: `error: ${body.error}` };
      } catch (e) {
        state.live[key] = { error: `error: ${e}` };
      }
      refresh(q);
    });
    box.append(b);
  }
  return box;
}

async function answer(q, seedIndex) {
  if (answers()[q.number]) return;
  const level = state.level;
  const r = await fetch("/api/answer", { method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ level: Number(level), number: q.number, choice: seedIndex }) });
  const body = await r.json();
  if (!r.ok) return;
  state.answers[level][q.number] = { choice: seedIndex, ...body };
  if (level === state.level) refresh(q);
}

function refresh(q) {
  document.getElementById(`q${q.number}`).replaceWith(renderQuestion(q));
  renderScore();
}

// ---- score and review -------------------------------------------------------------------
function renderScore() {
  const u = ui(), qs = questions(), total = qs.length, done = Object.values(answers());
  const right = done.filter((a) => a.right).length;
  $("#score").textContent = `${u.score} ${right}/${total} · ${done.length}/${total} ${u.answered}`;
  const review = $("#review");
  review.hidden = done.length < total;
  if (review.hidden) return review.replaceChildren();
  const missed = qs.filter((q) => !answers()[q.number].right);
  review.replaceChildren(el("h2", {}, u.review),
    ...(missed.length ? missed.map((q) => reviewItem(q, u)) : [el("p", {}, u.review_none)]),
    el("p", { id: "final" }, u.final.replace("{score}", right).replace("{total}", total)));
}

function reviewItem(q, u) {
  const t = q[state.lang], a = answers()[q.number];
  return el("div", { class: "missed" },
    el("p", { class: "text" }, `${q.number}. ${t.question}`),
    el("p", { class: "wrong" }, `${u.your_answer} ${t.options[a.choice]}`),
    el("p", { class: "right" }, `${u.correct_answer} ${t.options[a.answer]}`),
    el("p", { class: "explanation" }, a.explanation[state.lang]));
}

// ---- page -------------------------------------------------------------------------------
function render() {
  const d = state.data, u = ui();
  document.documentElement.lang = state.lang;
  document.title = d.title[state.lang];
  $("#title").textContent = d.title[state.lang];
  $("#intro").textContent = d.intro[state.lang];
  $("#restart").textContent = u.restart;
  for (const b of document.querySelectorAll("#langs button")) {
    b.setAttribute("aria-pressed", String(b.dataset.lang === state.lang));
  }
  for (const b of document.querySelectorAll("#levels button")) {
    b.textContent = u[`level_${b.dataset.level}`];
    b.setAttribute("aria-selected", String(b.dataset.level === state.level));
  }
  $("#questions").replaceChildren(...questions().map(renderQuestion));
  renderScore();
}

function setParam(key, value) {
  const url = new URL(location.href);
  url.searchParams.set(key, value);
  history.replaceState(null, "", url);
}

async function main() {
  const r = await fetch("/api/quiz");
  state.data = await r.json();
  const params = new URL(location.href).searchParams;
  state.lang = state.data.languages.includes(params.get("lang")) ? params.get("lang")
    : state.data.default_lang;
  state.level = ["1", "2"].includes(params.get("level")) ? params.get("level") : "1";
  state.seed = /^[0-9]{1,9}$/.test(params.get("seed") || "") ? Number(params.get("seed"))
    : Math.floor(Math.random() * 1e9);
  for (const b of document.querySelectorAll("#langs button")) {
    b.addEventListener("click", () => { state.lang = b.dataset.lang; setParam("lang", state.lang); render(); });
  }
  for (const b of document.querySelectorAll("#levels button")) {
    b.addEventListener("click", () => { state.level = b.dataset.level; setParam("level", state.level); render(); });
  }
  if (state.data.live) {
    const sel = $("#tp");
    for (const tp of state.data.live_tp) sel.append(el("option", { value: tp }, `${tp}`));
    sel.addEventListener("change", () => { state.tp = Number(sel.value); render(); });
    $("#tp-choice").hidden = false;
  }
  $("#restart").addEventListener("click", () => { state.answers[state.level] = {}; render(); });
  render();
}

main();
