"""The quiz: content in both languages, the terminal tutor, and the live demonstrations.

Content: 8 questions per language, 4 distinct options each, exactly one correct, the
same in both languages. Tutor: a scripted run shows the verdict, the correct option
and the explanation right after each answer, and ends with `Score: N/8`. Live: each
demonstration computes its figures on local gloo processes, and they change with tp;
it is told in the quiz's language from `live_text.json` (same templates, same fields).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from importlib import resources

import pytest

from tpkit.quiz.content import load_quiz, problems
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


@pytest.fixture(scope="module")
def quiz():
    return load_quiz()


# -- content -----------------------------------------------------------------------------
def test_eight_questions_four_options_one_answer_in_each_language(quiz):
    for lang in ("fr", "en"):
        items = quiz.items(lang)
        assert len(items) == 8
        for item in items:
            assert len(item.options) == 4 == len(set(item.options))
            assert item.question.strip() and item.explanation.strip()
        assert [i.correct + 1 for i in items] == SEED_ANSWERS


def test_same_correct_index_and_diagram_in_both_languages(quiz):
    fr, en = quiz.items("fr"), quiz.items("en")
    assert [(i.correct, i.diagram, i.id) for i in fr] == [(i.correct, i.diagram, i.id) for i in en]


def test_french_uses_the_field_s_words(quiz):
    text = json.dumps([(i.question, i.options, i.explanation) for i in quiz.items("fr")],
                      ensure_ascii=False)
    assert "all-reduce" in text and "convolution" in text and "par colonnes" in text
    assert "par lignes" in text
    assert "tout réduit" not in text and "circonvolution" not in text


def test_validation_names_the_problem(quiz):
    data = json.loads(resources.files("tpkit.quiz").joinpath("questions.json").read_text("utf-8"))
    assert problems(data) == []
    data["questions"][2]["answer"] = 4
    data["questions"][5]["en"]["options"].pop()
    found = problems(data)
    assert any("question 3: answer=4" in p for p in found)
    assert any("question 6 (en)" in p for p in found)
    data["questions"].pop()
    assert any("7 questions, expected 8" in p for p in problems(data))


def test_shuffle_keeps_each_answer_with_its_question(quiz):
    plain = {i.id: i.options[i.correct] for i in quiz.items("en")}
    shuffled = quiz.items("en", shuffle=True, seed=5)
    assert [i.id for i in shuffled] != [i.id for i in quiz.items("en")]
    assert {i.id: i.options[i.correct] for i in shuffled} == plain
    assert [i.options for i in quiz.items("en", shuffle=True, seed=5)] == \
        [i.options for i in shuffled]


# -- terminal tutor ------------------------------------------------------------------------
@pytest.mark.parametrize("lang", ["fr", "en"])
def test_scripted_run_explains_after_each_answer_and_scores(quiz, lang):
    items, ui, out = quiz.items(lang), quiz.ui(lang), io.StringIO()
    answers = [1, 2, 3, 1, 1, 4, 3, 4]  # questions 4 and 6 wrong
    score = run_tutor(items, ui, scripted([a - 1 for a in answers]), out, echo=True)
    text = out.getvalue()
    assert score == 6 and text.rstrip().splitlines()[-1] == "Score: 6/8"
    pos = 0
    for item, a in zip(items, answers):  # in order: question, answer, verdict, explanation
        pos = text.index(item.question[:40], pos)
        pos = text.index(f"> {a}", pos)
        verdict = ui["right"] if a - 1 == item.correct else ui["wrong"]
        pos = text.index(verdict, pos)
        pos = text.index(ui["correct_answer"], pos)
        pos = text.index(ui["explanation"], pos)
        assert item.explanation.split()[3] in text[pos:pos + 400]


def test_interactive_asks_again_on_a_bad_answer(quiz):
    replies = iter(["x", "9", "", "1"] + ["1"] * 7)  # three bad replies, then 1 everywhere
    out = io.StringIO()
    score = run_tutor(quiz.items("en"), quiz.ui("en"), interactive(lambda _: next(replies), out),
                      out)
    assert out.getvalue().count("Invalid answer") == 3
    assert score == 2  # option 1 is right for questions 1 and 5


def test_answers_parsing_and_errors():
    assert parse_answers("1,2,3,4,1,2,3,4", 8) == [0, 1, 2, 3, 0, 1, 2, 3]
    with pytest.raises(AnswerError, match="3 answers, expected 8"):
        parse_answers("1,2,3", 8)
    with pytest.raises(AnswerError, match="question 2: answer '5'"):
        parse_answers("1,5,3,4,1,2,3,4", 8)
    with pytest.raises(AnswerError, match="ended before question 1"):
        from_lines(io.StringIO("\n\n"))(load_quiz().items("en")[0], {})


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    code = "import sys; from tpkit.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "quiz", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(60)
def test_cli_scripted_stdin_bad_answers_and_no_torch():
    r = _cli("--lang", "fr", "--answers", "1,2,3,4,1,2,3,1")
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "Score: 7/8"
    assert r.stdout.count("Explication :") == 8 and "Bonne réponse :" in r.stdout
    r = _cli("--lang", "en", stdin="1\n2\n3\n4\n\n1\n2\n3\n4\n")
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "Score: 8/8"
    r = _cli("--answers", "1,2,7,4,1,2,3,4")
    assert r.returncode == 2 and "question 3: answer '7'" in r.stderr
    r = _cli("--lang", "en", stdin="1\n2\n")
    assert r.returncode == 2 and "ended before question 3" in r.stderr
    code = ("import sys; from tpkit.cli import main; main(['quiz', '--answers', "
            "'1,1,1,1,1,1,1,1']); assert 'torch' not in sys.modules, 'torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "Score: 2/8"


# -- live demonstrations (real runs on gloo processes; the suite's shared worker pools) ----------
@pytest.fixture(scope="module")
def live(pools):
    from tpkit.quiz.live import LiveSession

    return LiveSession(runner=pools.run)


def _both(live, number: int, **kw) -> tuple[dict, dict]:
    a, b = live.run(number, tp=2), live.run(number, tp=4)
    assert a["text"] != b["text"] and a["tp"] == 2 and b["tp"] == 4
    return a, b


@pytest.mark.timeout(120)
def test_live_1_weight_shapes_split_and_exact(live):
    for d, tp in zip(_both(live, 1), (2, 4)):
        assert [p["fc1"] for p in d["per_rank"]] == [[64 // tp, 16]] * tp  # columns of A
        assert [p["fc2"] for p in d["per_rank"]] == [[16, 64 // tp]] * tp  # rows of B
        assert d["max_abs_diff"] == 0.0


@pytest.mark.timeout(120)
def test_live_2_column_row_one_all_reduce_column_column_all_gathers(live):
    a, b = _both(live, 2)
    for d in (a, b):
        assert [r[:3] for r in d["column_row"]["records"]] == [
            ("all_reduce", "forward", 2 * 4 * 16), ("all_reduce", "backward", 2 * 4 * 16)]
        forward = [r[0] for r in d["column_column"]["records"] if r[1] == "forward"]
        assert forward == ["all_gather", "all_gather"]
        assert d["column_row"]["max_abs_diff"] < 1e-5 and d["column_column"]["max_abs_diff"] < 1e-5
    assert a["column_row"]["wire_bytes"] < b["column_row"]["wire_bytes"]  # 2(p-1)/p n


def _ledger_of_timed_all_reduces(mesh, numel: int, counts: tuple[int, ...]):
    from tpkit.quiz import live_ranks

    mesh.ledger.clear()
    live_ranks.all_reduce_times(mesh, numel, counts)
    return mesh.ledger.counts(group="tp")


@pytest.mark.timeout(120)
def test_live_3_and_8_planner_and_measured_all_reduces(live):
    a, b = _both(live, 3)
    for d in (a, b):
        assert d["planner"]["inter_s"] > 3 * d["planner"]["intra_s"] and d["local_layer_s"] > 0
    assert a["planner"]["intra_s"] != b["planner"]["intra_s"]
    a, b = _both(live, 8)
    for d in (a, b):
        assert d["counts"] == [1, 8, 64] and len(d["measured_s"]) == 3
        assert d["latency_inter_s"] > d["latency_intra_s"] > 0
    assert b["latency_intra_s"] == pytest.approx(3 * a["latency_intra_s"])  # 2(p-1) alpha
    # what was timed, from the ledger (not the clock): 3 warm-up + 1 + 8 + 64 all-reduces of
    # the 256 floats, and one 1-float all-reduce lining the ranks up before each count
    for got in live.spawn(_ledger_of_timed_all_reduces, 256, (1, 8, 64), tp=2):
        assert got == {("all_reduce", "forward", 256): 3 + 1 + 8 + 64,
                       ("all_reduce", "forward", 1): 3}


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
    if number == 5:
        assert d["records"] == [("all_reduce", "forward", 2 * 4 * 16, d["records"][0][3])]


@pytest.mark.timeout(120)
def test_live_6_rank_grid(live):
    from tpkit.quiz.live import demo_grid

    a, b = demo_grid(live, tp=2, pp=2), demo_grid(live, tp=4, pp=1)  # both on 4 ranks
    assert a["grid"] == [[[0, 1], [2, 3]]] and b["grid"] == [[[0, 1, 2, 3]]]
    assert [r["tp"] for r in a["ranks"]] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["pp"] for r in a["ranks"]] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert a["text"] != b["text"]


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
    assert "rang 1 : fc1 [32, 16] (colonnes de A)  fc2 [16, 32] (lignes de B)" in fr["text"]
    assert "rank 1: fc1 [32, 16] (columns of A)  fc2 [16, 32] (rows of B)" in en["text"]
    assert "rank" not in fr["text"] and "rang" not in en["text"]
    assert fr["per_rank"] == en["per_rank"]  # the same computed figures, told twice
    fr, en = live.run(2, tp=4, lang="fr"), live.run(2, tp=4, lang="en")
    assert "par colonnes -> par lignes" in fr["text"] and "octets envoyés" in fr["text"]
    assert "all-reduce en passe avant de 128 valeurs" in fr["text"]
    assert "all_reduce forward of 128 floats" in en["text"] and "passe" not in en["text"]
    assert fr["column_row"]["wire_bytes"] == en["column_row"]["wire_bytes"]
    fr = live.run(6, tp=2, lang="fr")["text"]
    assert "4 rangs : tp=2 × pp=2 × dp=1" in fr and "groupe tp [0, 1]" in fr


@pytest.mark.timeout(120)
def test_cli_live_shows_a_demonstration_after_each_answer():
    r = _cli("--live", "--lang", "en", "--answers", "1,2,3,4,1,2,3,3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("--- Live demonstration ---") == 8
    assert "max |diff|" in r.stdout and "all_gather forward" in r.stdout
    assert r.stdout.splitlines()[-1] == "Score: 7/8"
