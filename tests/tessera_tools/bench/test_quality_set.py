"""The shipped quality inputs (tessera_tools/fixtures/quality) and the grader of `tessera bench quality`."""

from __future__ import annotations

from tessera_tools.fixtures.quality import KINDS, Question, is_correct, questions, text


def test_question_set_is_well_formed():
    qs = questions()
    assert len(qs) >= 100
    assert len({q.id for q in qs}) == len(qs)
    assert {q.kind for q in qs} == set(KINDS)
    assert all(q.prompt and q.answers and all(a.strip() for a in q.answers) for q in qs)
    assert all(not q.prompt.endswith(" ") for q in qs if q.kind == "completion")


def test_grader_takes_whole_words_of_the_first_line():
    q = Question("x", "fact", "What is the capital of France?", ("paris",))
    assert is_correct(q, "The capital of France is Paris.")
    assert is_correct(q, "\n  PARIS!\nsomething else")
    assert not is_correct(q, "Parisian food is good.")          # not a whole word
    assert not is_correct(q, "It is Lyon.\nNo, Paris.")         # only the first line counts
    several = Question("y", "fact", "Which country?", ("united states", "usa"))
    assert is_correct(several, "The United States.") and not is_correct(several, "The United Kingdom states")


def test_perplexity_text_is_long_enough():
    # ~37,800 SmolLM2 tokens; at least 20,000 by the bar (4 characters a token is generous).
    assert len(text()) > 4 * 20_000 and "Down the Rabbit-Hole" in text()
