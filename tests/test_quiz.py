"""The quiz: content in both languages, the terminal tutor, and the live demonstrations.

Content: two levels of 8 questions, 4 distinct options each, exactly one correct, the
same in both languages; level 1 is the seed quiz word for word (in the language the
seed wrote each question in). Options are shown in a seeded order; `--answers` keeps
the seed's numbering. Tutor: a scripted run shows the verdict, the correct option and
the explanation right after each answer, reviews the missed ones and ends with the
score once. Live: each demonstration computes its figures on local gloo processes (or
with the planner), they change with tp, and each comes with a chart for the page. The
CLI's `quiz --live`, a demonstration after each answer: the README's line, run by
test_readme_lines.py.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from importlib import resources

import pytest

from tpkit.quiz.content import NBSP, NNBSP, load_quiz, problems, typeset
from tpkit.quiz.live_text import Say, templates
from tpkit.quiz.live_text import problems as text_problems
from tpkit.quiz.tutor import (
    AnswerError,
    from_lines,
    interactive,
    parse_answers,
    run_tutor,
    scripted,
)

SEED_ANSWERS = [1, 2, 3, 4, 1, 2, 3, 4]  # the seed's correct options, numbered 1..4
SEED = {  # the seed quiz, word for word: (language, question, options) for questions 1..8
    1: ("fr", "Qu'est-ce qui divise le parallélisme tensoriel entre les GPU ?",
        ["Les matrices de poids au sein d’une seule couche",
         "Couches entières placées sur des GPU séparés",
         "Différents ensembles de données de formation", "Le taux d'apprentissage de l'optimiseur"]),
    2: ("fr", "Dans la division MLP de style Megatron, comment les deux matrices de poids "
              "sont-elles partitionnées pour minimiser la communication ?",
        ["Les deux colonnes", "Première colonne, deuxième ligne", "Les deux en rangées",
         "Ils ne sont pas du tout cloisonnés"]),
    3: ("fr", "Pourquoi le parallélisme tensoriel est-il généralement conservé au sein d'un seul "
              "nœud ?",
        ["Les nœuds ne peuvent pas exécuter de GPU",
         "Les GPU dans différents nœuds utilisent des mathématiques différentes",
         "Il nécessite des communications fréquentes à large bande passante, mieux servies par "
         "NVLink", "C'est une obligation légale"]),
    4: ("fr", "Comment le mécanisme d'attention est-il généralement parallélisé sous le "
              "parallélisme tensoriel ?",
        ["En accordant à chaque GPU toute l'attention du calcul de manière redondante",
         "En ignorant complètement l'attention", "En convertissant l'attention en une circonvolution",
         "En répartissant les différentes têtes d'attention, chaque GPU gère un sous-ensemble"]),
    5: ("fr", "Quelle opération collective combine généralement des résultats partiels dans le "
              "parallélisme tensoriel ?",
        ["Un tout réduit", "Une copie de fichier", "Une jointure à une base de données",
         "Une recherche DNS"]),
    6: ("fr", "Comment le parallélisme tensoriel s'intègre-t-il généralement dans le « parallélisme "
              "3D » ?",
        ["Il remplace toutes les autres formes de parallélisme",
         "Il est combiné avec le parallélisme des pipelines et des données",
         "Cela fonctionne uniquement sans aucun autre parallélisme",
         "Il est utilisé uniquement pour les modèles d'image"]),
    7: ("en", "After the row-wise partition of an MLP’s second matrix, why must GPUs combine "
              "partial outputs?",
        ["The GPUs each hold a different optimizer",
         "The result is a vocabulary probability that must be sorted",
         "Each GPU computed a partial contribution to the same output, so the pieces must be "
         "summed", "The model needs to average separate datasets"]),
    8: ("en", "Why can interconnect latency limit tensor-parallel scaling across distant nodes?",
        ["Tensor parallelism never communicates between GPUs",
         "The attention mask must be copied after every token", "Every GPU trains a separate model",
         "Collectives are required repeatedly within layers, so communication latency "
         "accumulates"]),
}


def _plain(text: str) -> str:
    return text.replace(NBSP, " ").replace(NNBSP, " ")


@pytest.fixture(scope="module")
def quiz():
    return load_quiz()


# -- content -----------------------------------------------------------------------------
def test_level_1_is_the_seed_word_for_word(quiz):
    for number, (lang, question, options) in SEED.items():
        item = quiz.items(lang, seed=0)[number - 1]
        assert _plain(item.question) == question
        assert [_plain(item.options[item.shown(k)]) for k in range(4)] == options
        assert item.correct == item.shown(SEED_ANSWERS[number - 1] - 1)


@pytest.mark.parametrize("level", [1, 2])
def test_eight_questions_four_options_one_answer_in_each_language(quiz, level):
    for lang in ("fr", "en"):
        items = quiz.items(lang, level=level, seed=1)
        assert len(items) == 8
        for item in items:
            assert len(item.options) == 4 == len(set(item.options))
            assert item.question.strip() and item.explanation.strip()
            assert sorted(item.order) == [0, 1, 2, 3]


def test_same_answer_and_diagram_in_both_languages_and_ids_unique(quiz):
    for level in (1, 2):
        fr, en = quiz.items("fr", level, seed=4), quiz.items("en", level, seed=4)
        assert [(i.correct, i.diagram, i.id, i.order) for i in fr] == \
            [(i.correct, i.diagram, i.id, i.order) for i in en]
    ids = [q["id"] for q in quiz.data["questions"]]
    assert len(ids) == 16 == len(set(ids))


def test_options_order_is_seeded_and_not_the_seed_key(quiz):
    a, b = quiz.items("en", seed=11), quiz.items("en", seed=11)
    assert [i.options for i in a] == [i.options for i in b]  # reproducible with --seed
    positions = {tuple(i.correct for i in quiz.items("en", seed=s)) for s in range(20)}
    assert len(positions) > 10  # the right option moves from sitting to sitting
    assert all(i.options[i.correct] == _right(quiz, i) for i in quiz.items("fr", seed=3))


def _right(quiz, item):
    q = quiz.questions(item.level)[item.number - 1]
    return typeset(q["fr"]["options"][q["answer"]], "fr")


def test_notation_is_megatron_s_and_q2_names_f_and_g(quiz):
    for lang in ("fr", "en"):
        items = quiz.items(lang, seed=0)
        q2, q7 = _plain(items[1].explanation), _plain(items[6].explanation)
        assert "f " in q2 and "g " in q2 and "Y = GeLU(XA)" in q2 and "Z = Y1B1 + Y2B2" in q2
        assert "Z = YB = Y1B1 + Y2B2" in q7 and "B = [B1 ; B2]" in q7
        assert "Y = Y₁·B₁" not in q7


def test_french_typography_non_breaking_spaces(quiz):
    assert typeset("Pourquoi ? Oui : non ; si !", "fr") == \
        f"Pourquoi{NNBSP}? Oui{NBSP}: non{NNBSP}; si{NNBSP}!"
    assert typeset("Why ? a : b", "en") == "Why ? a : b"
    text = json.dumps([(i.question, i.options, i.explanation) for i in quiz.items("fr", seed=0)],
                      ensure_ascii=False)
    assert " ?" not in text and " :" not in text and " ;" not in text
    assert quiz.ui("fr")["answered"] == "répondues"


def test_validation_names_the_problem(quiz):
    data = json.loads(resources.files("tpkit.quiz").joinpath("questions.json").read_text("utf-8"))
    assert problems(data) == []
    data["questions"][2]["answer"] = 4
    data["questions"][5]["en"]["options"].pop()
    found = problems(data)
    assert any("question 3: answer=4" in p for p in found)
    assert any("question 6 (en)" in p for p in found)
    data["questions"].pop()
    assert any("level 2 has 7 questions, expected 8" in p for p in problems(data))
    with pytest.raises(ValueError, match="level 3 does not exist"):
        load_quiz().questions(3)


def test_shuffle_keeps_each_answer_with_its_question(quiz):
    plain = {i.id: i.options[i.correct] for i in quiz.items("en", seed=5)}
    shuffled = quiz.items("en", shuffle=True, seed=5)
    assert [i.id for i in shuffled] != [i.id for i in quiz.items("en", seed=5)]
    assert {i.id: i.options[i.correct] for i in shuffled} == plain


# -- terminal tutor ------------------------------------------------------------------------
@pytest.mark.parametrize("lang", ["fr", "en"])
def test_scripted_run_explains_after_each_answer_reviews_and_scores(quiz, lang):
    items, ui, out = quiz.items(lang, seed=2), quiz.ui(lang), io.StringIO()
    answers = [1, 2, 3, 1, 1, 4, 3, 4]  # seed numbering: questions 4 and 6 wrong
    score = run_tutor(items, ui, scripted([a - 1 for a in answers]), out, echo=True)
    text = out.getvalue()
    last = text.rstrip().splitlines()[-1]
    assert score == 6 and last == ui["score_line"].format(score=6, total=8)
    assert text.count(last) == 1  # the score once
    pos = 0
    for item, a in zip(items, answers):  # in order: question, answer, verdict, explanation
        pos = text.index(item.question[:40], pos)
        pos = text.index(f"> {item.shown(a - 1) + 1}", pos)
        verdict = ui["right"] if item.shown(a - 1) == item.correct else ui["wrong"]
        pos = text.index(verdict, pos)
        pos = text.index(ui["correct_answer"], pos)
        pos = text.index(ui["explanation"], pos)
    review = text[text.index(f"=== {ui['review']} ==="):]
    assert review.count(ui["your_answer"]) == 2
    assert items[3].question[:30] in review and items[5].question[:30] in review
    assert items[0].question[:30] not in review


def test_exact_score_line_for_scripts(quiz):
    out = io.StringIO()
    run_tutor(quiz.items("fr", seed=0), quiz.ui("fr"), scripted([a - 1 for a in SEED_ANSWERS]),
              out, exact_score=True)
    assert out.getvalue().splitlines()[-1] == "Score: 8/8"
    assert quiz.ui("fr")["review_none"] in out.getvalue()


def test_interactive_asks_again_on_a_bad_answer(quiz):
    items = quiz.items("en", seed=0)
    replies = iter(["x", "9", "", "1"] + ["1"] * 7)  # three bad replies, then 1 everywhere
    out = io.StringIO()
    score = run_tutor(items, quiz.ui("en"), interactive(lambda _: next(replies), out), out)
    assert out.getvalue().count("Invalid answer") == 3
    assert score == sum(i.correct == 0 for i in items)  # option shown first is right


def test_answers_parsing_and_errors_do_not_show_the_key():
    assert parse_answers("1,2,3,4,1,2,3,4", 8) == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(AnswerError, match="3 answers, expected 8") as e:
        parse_answers("1,2,3", 8)
    assert "1,2,3,4" not in str(e.value)
    with pytest.raises(AnswerError, match="question 2: answer '5'"):
        parse_answers("1,5,3,4,1,2,3,4", 8)
    with pytest.raises(AnswerError, match="ended before question 1"):
        from_lines(io.StringIO("\n\n"))(load_quiz().items("en")[0], {})


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    code = "import sys; from tpkit.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "quiz", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(300)  # seven fresh interpreters, on a loaded 2-core machine
def test_cli_scripted_stdin_bad_answers_and_no_torch(quiz):
    r = _cli("--lang", "fr", "--answers", "1,2,3,4,1,2,3,1")  # seed numbering, any seed
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "Score: 7/8"
    assert r.stdout.count(f"Explication{NBSP}:") == 8 and f"Bonne réponse{NBSP}:" in r.stdout
    shown = [i.correct + 1 for i in quiz.items("en", seed=9)]  # typed answers: as shown
    r = _cli("--lang", "en", "--seed", "9", stdin="\n".join(map(str, shown)) + "\n")
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "Score: 8/8"
    r = _cli("--lang", "fr", "--seed", "9", stdin="\n".join(map(str, shown)) + "\n")
    assert r.stdout.splitlines()[-1] == f"Score{NBSP}: 8/8"  # localised without --answers
    r = _cli("--answers", "1,2,7,4,1,2,3,4")
    assert r.returncode == 2 and "question 3: answer '7'" in r.stderr
    r = _cli("--lang", "en", stdin="1\n2\n")
    assert r.returncode == 2 and "ended before question 3" in r.stderr
    r = _cli("--level", "2", "--answers", "3,1,4,2,3,4,1,2")
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "Score: 8/8"
    code = ("import sys; from tpkit.cli import main; main(['quiz', '--answers', "
            "'1,1,1,1,1,1,1,1']); assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "Score: 2/8"


# -- live demonstrations (real runs on gloo processes; the suite's shared worker pools) ----------
CHART_KINDS = {"bars", "grid", "matrices", "sums"}


@pytest.fixture(scope="module")
def live(pools):
    from tpkit.quiz.live import LiveSession

    return LiveSession(runner=pools.run)


def _both(live, number: int, level: int = 1) -> tuple[dict, dict]:
    a, b = live.run(number, tp=2, level=level), live.run(number, tp=4, level=level)
    assert a["text"] != b["text"] and a["charts"] != b["charts"]
    for d in (a, b):
        assert d["charts"] and {c["kind"] for c in d["charts"]} <= CHART_KINDS
        json.dumps(d["charts"])  # the page gets them as JSON
    return a, b


@pytest.mark.timeout(120)
def test_live_1_weight_shapes_split_and_exact(live):
    for d, tp in zip(_both(live, 1), (2, 4)):
        assert [p["fc1"] for p in d["per_rank"]] == [[64 // tp, 16]] * tp  # columns of A
        assert [p["fc2"] for p in d["per_rank"]] == [[16, 64 // tp]] * tp  # rows of B
        assert d["max_abs_diff"] == 0.0
        assert [m["parts"] for m in d["charts"][0]["mats"]] == [tp, tp]  # drawn at this tp


@pytest.mark.timeout(120)
def test_live_2_column_row_one_all_reduce_column_column_all_gathers(live):
    a, b = _both(live, 2)
    for d in (a, b):
        assert [r[:3] for r in d["column_row"]["records"]] == [
            ("all_reduce", "forward", 2 * 4 * 16), ("all_reduce", "backward", 2 * 4 * 16)]
        forward = [r[0] for r in d["column_column"]["records"] if r[1] == "forward"]
        assert forward == ["all_gather", "all_gather"]
        assert d["column_row"]["max_abs_diff"] < 1e-5 and d["column_column"]["max_abs_diff"] < 1e-5
        assert [x["value"] for x in d["charts"][1]["bars"]] == \
            [d["column_row"]["wire_bytes"], d["column_column"]["wire_bytes"]]
    assert a["column_row"]["wire_bytes"] < b["column_row"]["wire_bytes"]  # 2(p-1)/p n


@pytest.mark.timeout(120)
def test_live_3_and_8_planner_and_counted_all_reduces(live):
    a, b = _both(live, 3)
    for d in (a, b):
        assert d["planner"]["inter_s"] > 3 * d["planner"]["intra_s"] and d["local_layer_s"] > 0
        inside, across = d["charts"][1]["rows"]
        tp = d["tp"]
        assert [c["text"] for c in inside["cells"] if c["color"] == "g0"] == \
            [str(r) for r in range(tp)]  # one node
        assert len({int(c["text"]) // 8 for c in across["cells"] if c["color"] == "g0"}) == 2
    assert a["planner"]["intra_s"] != b["planner"]["intra_s"]
    assert "simulated hosts not made here (this session measures on one host only)" in a["text"]
    a, b = _both(live, 8)
    for d in (a, b):
        counts = d["counts"]
        assert counts == [1, 2, 4, 8] and all(t > 0 for t in d["measured_s"])
        # what it claims to time, it ran: warm-up 5 + 9 repeats x (sum of k + 1 line-up each)
        assert d["ledger_all_reduces"] == [5 + 9 * (sum(counts) + len(counts))] * d["tp"]
        bars = d["charts"][0]["bars"]
        assert [x["ref"] for x in bars] == pytest.approx([k * bars[0]["value"] for k in counts])
        assert d["latency_inter_s"] > d["latency_intra_s"] > 0
        assert d["charts"][2]["kind"] == "grid" and d["charts"][2]["per_node"] == 8
        # the arithmetic beside the measurement: why k cost (or do not cost) k x one
        ratio, k = d["ratio_to_one"][-1], counts[-1]
        why = "why not 8 x: one alone" if abs(ratio - k) > 0.15 * k else "as the theory says"
        assert why in d["text"] and f"{ratio:.2f}" in d["text"]
        assert f"384 all-reduces per micro-batch x {d['each_s'] * 1e6:.1f} us" in d["text"]
    assert b["latency_intra_s"] == pytest.approx(3 * a["latency_intra_s"])  # 2(p-1) alpha


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_live_3_and_8_across_simulated_hosts_at_two_link_speeds(pools, tmp_path, monkeypatch):
    import os
    from pathlib import Path

    from tpkit.cluster.checks import missing
    from tpkit.quiz.live import LiveSession

    if missing():
        pytest.skip(missing())
    monkeypatch.setenv("TPKIT_CLUSTER_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("TPKIT_CLUSTER_SHM", str(tmp_path / "shm"))
    session = LiveSession(runner=pools.run, hosts=True)
    q3, q8 = session.run(3, tp=2), session.run(8, tp=2)  # one measurement per link, shared
    assert sorted(q3["hosts_s"]) == sorted(q8["hosts"]) == ["10gbit", "1gbit"]
    for link, t in q3["hosts_s"].items():
        assert t > 0 and f"link {link}: {t * 1e3:.2f} ms, {t / q3['local_layer_s']:.1f} x" \
            in q3["text"]
        each = q8["hosts"][link]["each_s"]
        assert f"384 per micro-batch = {384 * each * 1e3:.1f} ms" in q8["text"]
    names = [p.name for p in Path("/run/netns").glob(f"tq{os.getpid() % 100000}-*")]
    assert names == [] and not (tmp_path / "run").exists()  # every cluster removed


def test_a_line_through_sequences_splits_the_fixed_start_from_each_collective():
    from tpkit.quiz.live_common import start_and_each

    start, each = start_and_each({k: 30e-6 + k * 10e-6 for k in (1, 2, 4, 8)})
    assert start == pytest.approx(30e-6, rel=1e-9) and each == pytest.approx(10e-6, rel=1e-9)
    assert start_and_each({1: 5e-6, 2: 4e-6})[1] == 0.0  # never a negative cost


@pytest.mark.timeout(120)
def test_live_4_heads_per_rank(live):
    a, b = _both(live, 4)
    assert [p["q_heads"] for p in a["per_rank"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [p["kv_heads"] for p in b["per_rank"]] == [[0], [0], [1], [1]]  # shared kv heads
    for d in (a, b):
        assert d["layer_matches_arithmetic"] and d["max_abs_diff"] < 1e-5


@pytest.mark.timeout(120)
@pytest.mark.parametrize("number", [5, 7])
def test_live_5_7_partials_sum_to_the_single_device_output(live, number):
    for d in _both(live, number):
        assert len(d["partial_vs_ref"]) == d["tp"]
        assert min(d["partial_vs_ref"]) > 1e-3  # a partial alone is not the output
        assert d["sum_vs_ref"] < 1e-5
        chart = d["charts"][0]
        total = [sum(t["values"][k] for t in chart["terms"]) for k in range(4)]
        assert total == pytest.approx(chart["result"]["values"], abs=2e-4)  # terms add up
        assert chart["result"]["values"] == pytest.approx(chart["check"]["values"], abs=1e-4)
    if number == 5:
        assert d["records"] == [("all_reduce", "forward", 2 * 4 * 16, d["records"][0][3])]
    else:
        assert [t["label"] for t in chart["terms"]] == ["Y1B1", "Y2B2", "Y3B3", "Y4B4"]


@pytest.mark.timeout(120)
def test_live_6_rank_grid_with_nodes(live):
    from tpkit.quiz.live_level1 import demo_grid

    a, b = demo_grid(live, tp=2, pp=2), demo_grid(live, tp=4, pp=1)  # both on 4 ranks
    assert a["grid"] == [[[0, 1], [2, 3]]] and b["grid"] == [[[0, 1, 2, 3]]]
    assert [r["tp"] for r in a["ranks"]] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["pp"] for r in a["ranks"]] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    chart = a["charts"][0]
    assert chart["per_node"] == 2 and len(chart["rows"][0]["cells"]) == 4  # the ranks it ran
    assert a["text"] != b["text"]


# -- level 2 -------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_live_level2_ledger_and_planner_figures(live):
    for d in _both(live, 1, level=2):  # sequence parallelism: other ops, the same bytes
        assert d["sp_bytes"] == d["plain_bytes"] and d["sp_vs_ref"] < 1e-5
        assert sorted({r[0] for r in d["sp"]}) == ["all_gather", "reduce_scatter"]
    for d in _both(live, 2, level=2):  # vocab-parallel loss: 3 all-reduces of b*s
        assert [r[:3] for r in d["ce"]] == [("all_reduce", "forward", 8)] * 3
        assert [r[0] for r in d["emb"]] == ["all_reduce"] and d["loss_vs_ref"] < 1e-5
        assert d["gather_bytes"] > 10 * d["ce_bytes"]
    a, b = _both(live, 3, level=2)  # GQA, kv heads < tp: replicated
    assert a["matches"] and b["matches"]
    assert [p["kv_heads"] for p in b["per_rank"]] == [[0], [0], [1], [1]]
    for d in _both(live, 4, level=2):
        p = d["pp"]
        assert d["bubble"]["4"] == pytest.approx([(p - 1) / 4, (p - 1) / 8])
    for d in _both(live, 5, level=2):
        assert d["zero"]["optimizer"] == pytest.approx(d["plain"]["optimizer"] / d["dp"])
        assert d["zero"]["weights"] == d["plain"]["weights"]
    d = live.run(6, tp=2, level=2)
    assert d["tp16"]["step_s"] > d["tp8"]["step_s"] and d["tp16"]["tp_comm_s"] > d["tp8"]["tp_comm_s"]
    for d in _both(live, 7, level=2):
        p = d["tp"]
        assert d["measured_wire"] == 2 * (p - 1) / p * d["nbytes"]
    for d in _both(live, 8, level=2):
        assert d["z_vs_wrong"] == pytest.approx(d["expected_gap"], abs=1e-5) and d["bias"] == 0.5


def test_live_text_has_the_same_templates_and_fields_in_each_language():
    data = json.loads(json.dumps(templates()))  # a copy to break
    assert list(data) == ["en", "fr"] and text_problems(data) == []
    data["fr"]["split"]["rank"] = "  rang {rang} : fc1 {fc1}"
    del data["fr"]["grid"]["row"]
    found = text_problems(data)
    assert any("split.rank has fields ['fc1', 'rang']" in p for p in found)
    assert "fr: grid.row missing" in found
    assert Say("fr", "split").records([("all_reduce", "backward", 128, 512)]) == \
        "all-reduce en passe arrière de 128 valeurs"
    with pytest.raises(ValueError, match="no live text in language 'de'"):
        Say("de", "split")


@pytest.mark.timeout(120)
def test_live_text_in_the_quiz_language_same_figures(live):
    fr, en = live.run(1, tp=2, lang="fr"), live.run(1, tp=2, lang="en")
    assert f"rang 1{NBSP}: fc1" in fr["text"]
    fr["text"] = _plain(fr["text"])
    assert "rang 1 : fc1 [32, 16] (colonnes de A)  fc2 [16, 32] (lignes de B)" in fr["text"]
    assert "rank 1: fc1 [32, 16] (columns of A)  fc2 [16, 32] (rows of B)" in en["text"]
    assert "rank" not in fr["text"] and "rang" not in en["text"]
    assert fr["per_rank"] == en["per_rank"]  # the same computed figures, told twice
    fr, en = live.run(2, tp=4, lang="fr"), live.run(2, tp=4, lang="en")
    fr["text"] = _plain(fr["text"])
    assert "par colonnes -> par lignes" in fr["text"] and "octets envoyés" in fr["text"]
    assert "all-reduce en passe avant de 128 valeurs" in fr["text"]
    assert "all_reduce forward of 128 floats" in en["text"] and "passe" not in en["text"]
    assert fr["column_row"]["wire_bytes"] == en["column_row"]["wire_bytes"]
    fr = _plain(live.run(6, tp=2, lang="fr")["text"])
    assert "4 rangs : tp=2 × pp=2 × dp=1" in fr and "groupe tp [0, 1]" in fr
