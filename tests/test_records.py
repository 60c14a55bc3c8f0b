"""The record task of the fine-tuning study (docs/finetuning.md): examples are deterministic, every
sentence states each fact once, held-out sentences never occur in training, and the scorer gives
credit only for the exact format."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.experiments import finetune_study, records


def test_examples_are_pure_functions_of_seed_split_and_index():
    assert records.example(0, "train", 5) == records.example(0, "train", 5)
    assert records.example(0, "train", 5) != records.example(1, "train", 5)
    assert records.example(0, "train", 5) != records.example(0, "test", 5)
    with pytest.raises(ValueError, match="split 'val'"):
        records.example(0, "val", 0)


def test_every_template_states_each_fact_once_and_the_answer_parses_back():
    rec = {"name": "Uma Ito", "year": "1977", "city": "Oslo", "job": "architect"}
    for template in records.TEMPLATES:
        text = records.sentence(rec, template)
        for value in rec.values():
            assert text.count(value) == 1, (template, value)
        assert " a architect" not in text and "A architect" not in text  # "an" before a vowel
    assert records.parse(records.answer(rec)) == rec


def test_held_out_sentences_never_occur_in_training():
    train, test = records.splits(3, 400, 50)
    assert len(train) == 400 and len(test) == 50
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in test}
    assert len({e["prompt"] for e in test}) == 50
    assert all(e["prompt"].startswith(records.INSTRUCTION) for e in train + test)


def test_score_exact_format_and_fields():
    answers = ["name=A B|year=1950|city=Lima|job=chef"] * 4
    replies = ["name=A B|year=1950|city=Lima|job=chef\n",  # exact (a trailing newline is fine)
               "name=A B|year=1951|city=Lima|job=chef",  # the format, three fields of four
               "name=A B|city=Lima|year=1950|job=chef",  # fields out of order: not the format
               "A B was born in 1950."]
    s = records.score(replies, answers)
    assert s == {"exact": 0.25, "format": 0.5, "fields": (1 + 0.75) / 4, "n": 4}
    with pytest.raises(ValueError):
        records.score(["x"], answers)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_parse_never_raises_and_only_accepts_the_four_fields_in_order(reply):
    got = records.parse(reply)
    assert got is None or list(got) == list(records.FIELDS)
    s = records.score([reply], ["name=A|year=1|city=C|job=j"])
    assert 0.0 <= s["fields"] <= s["format"] <= 1.0 and s["exact"] <= s["format"]


def test_wilson_interval():
    assert finetune_study.wilson(0.0, 128)[0] == 0.0
    lo, hi = finetune_study.wilson(0.5, 100)
    assert lo == pytest.approx(0.4038, abs=1e-4) and hi == pytest.approx(0.5962, abs=1e-4)
    assert all(math.isnan(x) for x in finetune_study.wilson(0.5, 0))
