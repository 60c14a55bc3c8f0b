"""The fine-tuning study on BIG-bench tasks (make finetune-tasks, docs/finetuning.md#real-tasks): the
seeded split and its renderings, the drift monitor against hand-computed values, and a miniature of
the study (a tiny random checkpoint, a generated task in BIG-bench JSON, two steps)."""

import dataclasses
import json
import math

import numpy as np
import pytest

from diloco import hf, report
from diloco.algo import drift
from diloco.algo import syncer as sync
from diloco.algo.outer import make_outer
from diloco.config import ConfigError
from diloco.evaluation import bigbench_data as bb
from diloco.evaluation.tasks import GENERATE, MULTIPLE_CHOICE, TaskError, load_task
from diloco.experiments import finetune_tasks as ft
from diloco.experiments.spec import Variant, _compose, dp_reference
from diloco.hf.tokenizer import load_tokenizer
from diloco.model import build
from syncer_frames import FRAGS, THETA0, B, W, frame, merges, policy, start
from test_finetune import TINY
from test_generate_cli import FIXTURES

E = ("embed",)  # fragment 1's one tensor in syncer_frames


def mc_task(n=20):
    return {"name": "mini", "task_prefix": "Say if it is true.", "preferred_score": "multiple_choice_grade",
            "examples": [{"input": f"{i} is even", "target_scores": {"yes": int(i % 2 == 0), "no": int(i % 2)}}
                         for i in range(n)]}


def add_task(n=20):
    return {"name": "add", "preferred_score": "exact_str_match", "output_regex": r"[-+]?\d+",
            "examples": [{"input": f"What is {i} plus {i + 1}?", "target": str(2 * i + 1),
                          "target_scores": {str(2 * i + 1): 1.0, "banana": 0.0}} for i in range(n)]}


# ---- the split and its renderings ---------------------------------------------------------------

def test_split_is_seeded_disjoint_and_complete():
    raw = add_task(30)
    train, test = bb.split(raw, seed=0, test_size=8)
    again = bb.split(raw, seed=0, test_size=8)
    other = bb.split(raw, seed=1, test_size=8)
    assert (train, test) == again and test != other[1]
    inputs = [e["input"] for e in train + test]
    assert len(test) == 8 and len(train) == 22 and sorted(inputs) == sorted(e["input"] for e in raw["examples"])
    with pytest.raises(TaskError, match="test_size=30 must be between 1 and 29"):
        bb.split(raw, 0, 30)


def test_arithmetic_is_generative_and_sports_like_tasks_multiple_choice(tmp_path):
    """2_digit_addition's examples carry target and target_scores; it prefers exact match."""
    assert bb.generative(add_task()) and not bb.generative(mc_task())
    path = tmp_path / "task.json"
    path.write_text(json.dumps(add_task()))
    assert load_task(path).output_type == GENERATE
    path.write_text(json.dumps(mc_task()))
    assert load_task(path).output_type == MULTIPLE_CHOICE


def test_train_conversations_and_the_scored_prompt_are_the_same_text(tmp_path):
    """The test split is scored in the chat wrapping its training conversations are rendered with:
    the scored context + answer is the rendered conversation's text up to the answer's end."""
    tok = load_tokenizer(FIXTURES / "tokenizer")
    src = tmp_path / "task.json"
    src.write_text(json.dumps(mc_task()))
    out = bb.write_splits(src, "mini", 0, 5, tmp_path / "d", bb.chat_wrapping(tok))
    assert (out["n_train"], out["n_test"], out["generative"]) == (15, 5, False)
    conv = json.loads(open(out["train"]).readline())
    assert conv["prompt"].startswith("Say if it is true.\nQ: ") and conv["response"] in ("yes", "no")
    task = load_task(out["test"])
    doc = task.test[0]
    raw_test = json.loads((tmp_path / "d" / "test.json").read_text())["examples"][0]
    question = bb.question(mc_task(), raw_test)
    rendered = tok.render_chat([{"role": "user", "content": question},
                                {"role": "assistant", "content": doc.choices[doc.gold]}])
    assert rendered.startswith(task.description + doc.context + task.target_delimiter + doc.choices[doc.gold])


def test_tasks_the_sdist_lacks_need_a_path(tmp_path):
    with pytest.raises(TaskError, match="sports_understanding.*vocab.json.*tasks.sports_understanding=<path>"):
        bb.fetch("sports_understanding", tmp_path)
    with pytest.raises(TaskError, match="not found"):
        bb.fetch("mine", tmp_path, str(tmp_path / "missing.json"))


FAKE_API = """
class TaskMetadata:
    def __init__(self, **kw):
        self.__dict__.update(kw)
class ScoreData:
    def __init__(self, score_dict, **kw):
        self.score_dict = score_dict
class Task:
    pass
"""

FAKE_TASK = """
import random
import bigbench.api.task as task
class WebOfLiesTask(task.Task):
    def __init__(self, seed=42):
        random.seed(seed)
    def get_task_details(self):
        return task.TaskMetadata(name="web_of_lies", description="fake", keywords=["multiple choice"])
    def evaluate_model(self, model):
        out = []
        for length in (1, 3):
            qs, answers = [], []
            for _ in range(4):
                lies = [random.random() < 0.5 for _ in range(length)]
                text = " ".join(("P%d lies." if lie else "P%d tells the truth.") % i for i, lie in enumerate(lies))
                qs.append("Question: " + text + " Does P%d tell the truth?\\nAnswer: " % (length - 1))
                answers.append(sum(lies) % 2 == 0 if SCORE_RIGHT else True)
            ps = model.cond_log_prob(inputs=qs, targets=[["Yes", "No"]] * len(qs))
            right = sum(a == (p[0] >= p[1]) for a, p in zip(answers, ps))
            out.append(task.ScoreData({"multiple_choice_grade": right / len(qs)}))
        return out
"""


def fake_sdist(root, score_right=True):
    """An sdist tree with a stand-in bigbench.api.task and a web_of_lies Task class that asks its
    questions as the real one does (score_right=False: its own scoring disagrees with them)."""
    api = root / "bigbench" / "api"
    module = root / bb.PROGRAMMATIC["web_of_lies"][0]
    for folder in (api, module.parent):
        folder.mkdir(parents=True, exist_ok=True)
    for init in (root / "bigbench" / "__init__.py", api / "__init__.py"):
        init.write_text("")
    (api / "task.py").write_text(FAKE_API)
    module.write_text(f"SCORE_RIGHT = {score_right}\n" + FAKE_TASK)
    return root


def test_a_programmatic_task_is_recorded_from_its_own_class_and_checked(tmp_path):
    """web_of_lies is made by running the sdist's Task class: its questions verbatim, each answer read
    off the question and checked against the class's own scoring."""
    import random

    state = random.getstate()
    raw = bb.recorded("web_of_lies", fake_sdist(tmp_path / "good"))
    assert random.getstate() == state and not any(m.startswith("bigbench") for m in __import__("sys").modules)
    assert len(raw["examples"]) == 8 and raw["preferred_score"] == "multiple_choice_grade"
    for e in raw["examples"]:
        text = e["input"]
        assert text.startswith("Question: P0 ") and text.endswith("tell the truth?\nAnswer: ")
        assert e["target_scores"]["Yes"] == float(text.count(" lies.") % 2 == 0) == 1 - e["target_scores"]["No"]
    assert not bb.generative(raw) and raw["append_choices_to_input"] is False
    with pytest.raises(TaskError, match="disagree with its own scoring"):
        bb.recorded("web_of_lies", fake_sdist(tmp_path / "bad", score_right=False))


def test_the_answers_read_off_web_of_lies_and_boolean_expressions():
    ask = "Question: Ka lies. Jim says Ka lies. Sal says Jim tells the truth. Does Sal tell the truth?\nAnswer: "
    assert bb._lies(ask, ["Yes", "No"]) == 0  # two lies: Sal tells the truth
    assert bb._lies(ask.replace("Question: Ka lies.", "Question: Ka tells the truth."), ["Yes", "No"]) == 1
    shots = "not True or False is False . ( True ) and not False is True . "
    assert bb._boolean(shots + "not ( True and False ) is ", ["True", "False"]) == 0
    assert bb._boolean(shots + "False or not True is ", ["True", "False"]) == 1
    with pytest.raises(TaskError, match="unexpected question"):
        bb._boolean("__import__('os') is ", ["True", "False"])


def test_bad_study_configs_name_the_values():
    with pytest.raises(ConfigError, match="no tasks"):
        ft.parse({"variants": [{"label": "dp"}]})
    with pytest.raises(ConfigError, match=r"only=\['x'\] must name variants of \['dp'\]"):
        ft.parse({"tasks": {"a": ""}, "variants": [{"label": "dp"}], "only": ["x"]})


def test_default_study_runs_each_method_at_equal_rows_a_step(tmp_path):
    # Each config composes in about 0.5 s: two seeds of two of the six variants (the others differ
    # from these by LoRA or M, checked in their overrides)
    cfg = ft.parse(_compose("finetune_tasks", ["seeds=[0,1]", "only=[dp,diloco_lora_m4]"]))
    assert list(cfg.tasks) == ["2_digit_addition", "boolean_expressions"]  # both made from the sdist
    assert set(cfg.tasks) <= set(bb.GENERATED) | set(bb.PROGRAMMATIC) and not any(cfg.tasks.values())
    variants = {v.label: v.overrides for v in cfg.variants}
    assert list(variants) == ["dp", "dp_lora", "diloco_m2", "diloco_m4", "diloco_lora_m2", "diloco_lora_m4"]
    for label, o in variants.items():
        assert ("finetune=lora" in o) == ("lora" in label)
        assert ("runtime.learners=2" in o and "data.batch_size=4" in o) == label.endswith("m2")
    settings, jobs = ft.jobs(cfg, "t", tmp_path / "c.gguf", tmp_path / "train.jsonl")
    by = {(j.variant, j.seed): j.cfg for j in jobs}
    assert len(jobs) == 2 * 2
    for (label, _), c in by.items():
        M = c.runtime.learners if c.algo == "diloco" else 1
        assert M * c.data.batch_size == 8 and c.run.steps == by[("dp", 0)].run.steps
        assert (c.finetune.lora.rank > 0) == ("lora" in label)
        assert c.algo != "diloco" or c.syncer.quorum == 1
    assert by[("diloco_lora_m4", 0)].runtime.learners == 4
    assert {c.run.seed for c in by.values()} == {0, 1}
    # the bytes' reference is data parallel among the base's 4 slices, also where only DiLoCo runs
    only_m2 = ft.parse(_compose("finetune_tasks", ["seeds=[0]", "only=[diloco_m2]"]))
    settings, (job,) = ft.jobs(only_m2, "t", tmp_path / "c.gguf", tmp_path / "train.jsonl")
    ref = dp_reference(settings.experiment, 0, settings)
    assert job.cfg.runtime.learners == 2 and (ref.algo, ref.runtime.learners) == ("dp", 4)


# ---- the drift monitor --------------------------------------------------------------------------

def _round(merge, deltas, weights=None):
    """One round of len(deltas) learners on fragment 0 (K = M), each at Theta_0 - delta."""
    M = len(deltas)
    pol = policy(K=M, merge=merge, outer=make_outer("sgd", lr=1.0, momentum=0.0))
    st = start(pol, M=M)
    for m, d in enumerate(deltas):
        local = {p: THETA0[0][p] - d[p] for p in d}
        st, _ = sync.on_contribution(pol, st, frame(local, THETA0[0], learner=m, c_tokens=(weights or [8] * M)[m]),
                                     now=m / 10)
    (rec,) = merges(st)
    return rec["cosine"]


def _flat(d):
    return np.concatenate([d[B].ravel(), d[W].ravel()]).astype(np.float64)


def _cos(a, b):
    return float(_flat(a) @ _flat(b) / np.linalg.norm(_flat(a)) / np.linalg.norm(_flat(b)))


@pytest.mark.parametrize("merge", ["average", "rda_fragment"])
def test_two_learners_round_cosine_is_their_pseudo_gradients_cosine(merge):
    rng = np.random.default_rng(0)
    a = {W: rng.normal(size=(2, 3)).astype(np.float32), B: rng.normal(size=2).astype(np.float32)}
    b = {W: (a[W] + rng.normal(size=(2, 3))).astype(np.float32), B: rng.normal(size=2).astype(np.float32)}
    assert _round(merge, [a, b]) == pytest.approx(_cos(a, b), abs=1e-6)
    assert _round(merge, [a, a]) == pytest.approx(1.0, abs=1e-6)
    assert _round(merge, [a, {p: -x for p, x in a.items()}]) == pytest.approx(-1.0, abs=1e-6)


def test_three_equal_norm_learners_give_the_mean_pairwise_cosine():
    """Under RDA over the fragment each delta is folded as a unit vector: the plain mean of the
    three pairwise cosines, at unequal norms too."""
    e = [np.eye(8)[i] for i in range(3)]
    vecs = [3 * e[0], 0.5 * (e[0] + e[1]), 2 * (e[0] + e[1] + e[2])]

    def as_delta(v):
        return {B: v[:2].astype(np.float32), W: v[2:].reshape(2, 3).astype(np.float32)}

    ds = [as_delta(v) for v in vecs]
    want = np.mean([_cos(ds[i], ds[j]) for i, j in ((0, 1), (0, 2), (1, 2))])
    assert _round("rda_fragment", ds) == pytest.approx(want, abs=1e-6)
    # one learner: no pair, no cosine
    assert _round("rda_fragment", ds[:1]) is None


def test_distance_per_fragment_relative_to_the_base():
    theta = {W: THETA0[0][W] + 3.0, B: THETA0[0][B], ("embed",): THETA0[1][("embed",)] * 0}
    base = {**THETA0[0], **THETA0[1]}
    d = drift.summary(theta, base, FRAGS)
    base_norm = math.sqrt(float(np.sum(THETA0[0][W].astype(np.float64) ** 2) + np.sum(THETA0[0][B] ** 2)))
    assert d["drift"][0]["l2"] == pytest.approx(math.sqrt(6 * 9.0))
    assert d["drift"][0]["rel"] == pytest.approx(math.sqrt(54.0) / base_norm)
    assert d["drift"][1]["rel"] == pytest.approx(1.0)  # moved to zero: its whole norm
    assert d["drift_rel_max"] == max(d["drift"][0]["rel"], 1.0)
    text = report.render_summary({**d, "pseudograd_cos_mean": 0.25, "pseudograd_cos_rounds": 3}, "run")
    (line,) = [x for x in text.splitlines() if x.strip().startswith("drift")]
    assert line.endswith(f"largest fragment {d['drift_rel_max']:.4f} of the base's norm; "
                         "pseudo-gradient cosine 0.250 (3 rounds)")
    zero = drift.distance({E: np.ones(2)}, {E: np.zeros(2)}, [FRAGS[1]._replace(paths=(E,))])
    assert zero == [{"fragment": 1, "l2": pytest.approx(math.sqrt(2)), "rel": None}]  # LoRA's B starts at 0



# ---- the miniature study ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    tok = load_tokenizer(FIXTURES / "tokenizer")
    shape = dataclasses.replace(TINY, max_seq_len=256)
    return hf.save(tmp_path_factory.mktemp("ck") / "ckpt", shape, build(shape, tok.vocab_size, seed=0).params, tok)


@pytest.mark.slow  # 32-101 s (load average 15-20): a DP and a DiLoCo run of two steps, compiled and scored
def test_miniature_study_writes_the_table_from_its_runs(tiny_ckpt, tmp_path):
    src = tmp_path / "add.json"
    src.write_text(json.dumps(add_task(40)))
    fast = ["run.steps=2", "inner.warmup_steps=0", "data.seq_len=128", "run.log_every=1", "codec=fp32",
            "codec.zstd_level=0", "data.val_fraction=0.2"]
    cfg = dataclasses.replace(
        ft.parse(_compose("finetune_tasks", [])), checkpoint=str(tiny_ckpt), tasks={"add": str(src)},
        test_size=4, seeds=(0,), max_gen_toks=2, score_batch=2, eval_sequences=4, out_dir=str(tmp_path / "out"),
        compilation_cache="", overrides=tuple(fast),
        variants=(Variant("dp", ("algo=dp", "data.batch_size=4")),
                  Variant("diloco_m2", ("data.batch_size=2", "runtime.learners=2", "fragments.count=1",
                                        "fragments.H=1", "fragments.tau=0", "syncer.quorum=2"))))
    md, js = ft.run(cfg)
    result = json.loads(js.read_text())
    base, rows = result["before"]["add"], result["rows"]
    assert base["metric"] == "exact_match" and base["n"] == 4 and base["eval_loss"] > 3.0
    dp, dl = rows
    assert (dp["variant"], dl["variant"]) == ("dp", "diloco_m2") and dp["bytes_over_dp"] == 1.0
    for r in rows:  # the numbers are the runs' own: their summaries and their score files
        run_dir = tmp_path / "out" / "finetune_tasks" / "add" / r["variant"] / "seed0"
        summary = json.loads((run_dir / "summary.json").read_text())
        score = json.loads((run_dir / "task_score.json").read_text())
        assert r["eval_loss"] == summary["eval_loss"] and r["value"] == score["value"]
        assert 0.0 <= r["low"] <= r["value"] <= r["high"] <= 1.0 and r["n"] == 4
    summary = json.loads((tmp_path / "out" / "finetune_tasks" / "add" / "diloco_m2" / "seed0" / "summary.json").read_text())
    assert dl["bytes"] == summary["bytes_up"] + summary["bytes_down"] > 0
    assert dl["drift_rel_max"] == summary["drift_rel_max"] > 0 and -1.0 <= dl["pseudograd_cos_mean"] <= 1.0
    assert dl["tokens_merged_share"] == summary["tokens_merged_share"] == 1.0  # H = 1, tau = 0: every step merged
    assert "tokens_merged_share" not in dp
    table = md.read_text().splitlines()
    assert table[4].startswith("| task | model | seed | metric [95% CI] | n | held-out masked loss | bytes sent |")
    assert table[6].startswith("| add | base |") and table[7].startswith("| add | dp | 0 | exact_match")
    assert table[8].startswith("| add | diloco_m2 | 0 |") and f"| {dl['drift_rel_max']:.4f} of the base |" in table[8]
    assert "| 1.000 |" in table[8] and table[7].count("|") == table[8].count("|") == table[4].count("|")
    assert len(score["correct"]) == 4 and score["correct"].count("1") == round(score["value"] * 4)
    assert table[-1].startswith("| add | diloco_m2 | dp | 0 |")  # paired with DP on the same questions


def test_each_diloco_run_is_paired_with_the_dp_run_trained_the_same_way():
    """LoRA against DP + LoRA, every weight against DP, the same seed; McNemar on the questions."""
    def r(variant, algo, seed, lora, correct):
        return {"task": "add", "variant": variant, "algo": algo, "seed": seed, "params": 100,
                "trained_params": 10 if lora else 100, "correct": correct}
    rows = [r("dp", "dp", 0, False, "11110000"), r("dp_lora", "dp", 0, True, "10000000"),
            r("diloco_m2", "diloco", 0, False, "11111111"), r("diloco_lora_m2", "diloco", 0, True, "00000000"),
            r("diloco_m2", "diloco", 1, False, "1")]  # seed 1 has no DP run: no line
    assert ft.reference(rows[2], rows) is rows[0] and ft.reference(rows[3], rows) is rows[1]
    assert ft.reference(rows[4], rows) is None
    lines = ft.paired_table(rows).strip().splitlines()
    assert lines[0] == "| task | model | against | seed | points | right only here | right only there | McNemar p |"
    assert lines[2] == "| add | diloco_m2 | dp | 0 | +50.0 | 4 | 0 | 0.125 |"  # 4 to 0: 2 / 16
    assert lines[3] == "| add | diloco_lora_m2 | dp_lora | 0 | -12.5 | 0 | 1 | 1 |" and len(lines) == 4


def test_a_round_where_one_pseudo_gradient_dwarfs_the_other_has_no_cosine_and_never_raises():
    """A fuzzed frame 1e20 times another's norm (tests/test_hardening.py's frame fuzz found it):
    (sum ||v||)^2 - sum ||v||^2 cancelled to 0 and the merge divided by zero. The pairs are summed
    one by one now, and a cosine that rounding put outside [-1, 1] is None."""
    from types import SimpleNamespace

    from diloco.algo import drift, roundsum
    rule = SimpleNamespace(coefficients=lambda weight, norms: (1.0,) * len(norms), clip_rebuilds=False)
    parts = (SimpleNamespace(weight=1.0, norms=(0.07,)), SimpleNamespace(weight=1.0, norms=(1e19,)))
    total = np.array([1e19, 0.07, 0.0, 0.0], np.float32)
    rs = SimpleNamespace(parts=parts, sums=(total,), scales=(1.0,))
    assert roundsum.norm(total) > 0
    assert drift.agreement(rs, rule, [1.0, 1.0]) is None
    # ordinary vectors still give their cosine
    a, b = np.array([1.0, 0.0], np.float32), np.array([1.0, 1.0], np.float32)
    parts = (SimpleNamespace(weight=1.0, norms=(1.0,)), SimpleNamespace(weight=1.0, norms=(float(np.linalg.norm(b)),)))
    rs = SimpleNamespace(parts=parts, sums=(a + b,), scales=(1.0,))
    assert drift.agreement(rs, rule, [1.0, 1.0]) == pytest.approx(1 / np.sqrt(2), abs=1e-6)
