"""Two models compared on the same test documents (diloco/evaluation/paired.py): the exact McNemar
test against hand-computed binomial tails, its symmetry under hypothesis, both score files it reads
(scripts/evaluate.py's output= and the study's task_score.json), and bad inputs as one error."""

import io
import json
from math import comb

import pytest
from hypothesis import given
from hypothesis import strategies as st

from diloco.config import ConfigError
from diloco.evaluation import parse, run
from diloco.evaluation.paired import as_bits, compare, mcnemar, read


def test_mcnemar_is_the_exact_binomial_tail_of_the_disagreements():
    # 12 disagreements, 10 to 2: p = 2 * (C(12,0) + C(12,1) + C(12,2)) / 2^12 = 158 / 4096
    a = [True] * 10 + [False] * 2 + [True] * 5 + [False] * 3
    b = [False] * 10 + [True] * 2 + [True] * 5 + [False] * 3
    m = mcnemar(a, b)
    assert (m["n"], m["a_only"], m["b_only"]) == (20, 10, 2)
    assert m["p"] == pytest.approx(158 / 4096, rel=1e-12) and m["diff"] == pytest.approx(-8 / 20)
    assert mcnemar([True] * 5 + [False], [False] * 5 + [False])["p"] == pytest.approx(2 / 32)  # 5 to 0
    assert mcnemar([True, False, True], [True, False, True])["p"] == 1.0  # never disagree
    assert mcnemar([True, False], [False, True])["p"] == 1.0  # 1 to 1: the whole distribution, capped
    big = mcnemar([True] * 3000, [False] * 3000)  # 2 / 2^3000 underflows to 0, without an overflow
    assert big["p"] == 0.0 and big["a_only"] == 3000
    with pytest.raises(ValueError, match="not the same test set"):
        mcnemar([True], [True, False])


@given(st.lists(st.tuples(st.booleans(), st.booleans()), max_size=60))
def test_mcnemar_is_symmetric_and_a_probability(pairs):
    a, b = [x for x, _ in pairs], [y for _, y in pairs]
    m, w = mcnemar(a, b), mcnemar(b, a)
    assert m["p"] == w["p"] and 0.0 <= m["p"] <= 1.0 and m["diff"] == -w["diff"]
    k, n = min(m["a_only"], m["b_only"]), m["a_only"] + m["b_only"]
    assert m["p"] == (1.0 if n == 0 else min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n))


def _evaluate_output(path, task, metric, correct):
    docs = [{metric: c, "output": "x"} for c in correct]
    path.write_text(json.dumps({"tasks": [{"task": task, "n": len(docs), "metrics": {}, "docs": docs}]}))
    return str(path)


def test_compare_reads_both_files_and_tables_each_against_the_first(tmp_path):
    ref = _evaluate_output(tmp_path / "ref.json", "add", "exact_match", [True, True, False, False, True])
    study = tmp_path / "study" / "add"
    study.mkdir(parents=True)
    (study / "task_score.json").write_text(json.dumps({"task": "add", "metric": "exact_match", "correct": as_bits(
        [False, True, True, True, True])}))
    mc = _evaluate_output(tmp_path / "mc.json", "add", "exact_match", [True, True, False, False, False])
    assert read(study / "task_score.json") == {"add": ("exact_match", [False, True, True, True, True])}
    out = io.StringIO()
    result = run(parse({"compare": [ref, str(study / "task_score.json"), mc]}), out)["compare"]
    assert [(r["a_only"], r["b_only"]) for r in result] == [(1, 2), (1, 0)]
    assert result[0]["reference_value"] == 0.6 and result[0]["other_value"] == 0.8
    text = out.getvalue()
    assert "McNemar p" in text and "+0.2000" in text and ref in text


def test_bad_compare_inputs_are_one_error_naming_the_files(tmp_path):
    a = _evaluate_output(tmp_path / "a.json", "add", "exact_match", [True, False])
    b = _evaluate_output(tmp_path / "b.json", "add", "exact_match", [True, False, True])
    other = _evaluate_output(tmp_path / "c.json", "mult", "exact_match", [True, False])
    other2 = _evaluate_output(tmp_path / "c2.json", "sub", "exact_match", [True, False])
    (tmp_path / "loss.json").write_text(json.dumps({"tokens": 5, "nats_per_token": 1.0}))
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ConfigError, match="b.json 3: not the same test set"):
        compare([a, b], io.StringIO())
    with pytest.raises(ConfigError, match="share no task"):  # two tasks each side, none in common
        compare([a, str(_two(tmp_path, other, other2))], io.StringIO())
    with pytest.raises(ConfigError, match="no per-document results"):
        compare([a, str(tmp_path / "loss.json")], io.StringIO())
    acc = _evaluate_output(tmp_path / "acc.json", "add", "acc", [True, False])
    with pytest.raises(ConfigError, match="scored add by exact_match and .*acc.json by acc"):
        compare([a, acc], io.StringIO())
    with pytest.raises(ConfigError, match="junk.json is not a readable JSON"):
        compare([a, str(tmp_path / "junk.json")], io.StringIO())
    with pytest.raises(ConfigError, match="needs two or more existing score files: not found: .*none.json"):
        parse({"compare": [a, str(tmp_path / "none.json")]})
    with pytest.raises(ConfigError, match="needs two or more"):
        parse({"compare": [a]})
    # one task each side under other names: matched (a renamed copy of the same test set)
    assert compare([a, other], io.StringIO())[0]["task"] == "add"


def _two(tmp_path, *paths):
    tasks = [json.loads(open(p).read())["tasks"][0] for p in paths]
    (tmp_path / "two.json").write_text(json.dumps({"tasks": tasks}))
    return tmp_path / "two.json"


@pytest.mark.parametrize("raw", [
    {"tasks": ["add/task.json"]},  # a config's list of task files, not scores
    {"tasks": "add"},
    {"tasks": [{"task": "add", "docs": [{"exact_match": True}, {"f1": 0.5}]}]},  # a record without the metric
    {"tasks": [{"docs": [{"exact_match": True}]}]},  # no task name
    {"tasks": [{"task": "add", "docs": "11"}]},
])
def test_a_score_file_of_another_shape_is_one_error_not_a_traceback(tmp_path, raw):
    a = _evaluate_output(tmp_path / "a.json", "add", "exact_match", [True, False])
    (tmp_path / "other.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="other.json has no per-document results"):
        compare([a, str(tmp_path / "other.json")], io.StringIO())
