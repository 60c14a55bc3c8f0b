"""Bandwidth model: closed forms, hand-computed utilisations, Table 4, the byte ledger check, bad inputs."""

import json
import math

import numpy as np
import pytest
import yaml

from diloco.algo.codecs import CODECS, make_codec
from diloco.bandwidth import analytic as A
from diloco.bandwidth import table4
from diloco.bandwidth.blog import blog_claim
from diloco.bandwidth.measured import measured_vs_analytic, sends_per_learner
from diloco.bandwidth.report import build, load_config, markdown
from diloco.bandwidth.utilisation import (Method, Workload, data_parallel, decoupled_diloco, required_bandwidth,
                                          streaming_diloco, utilisation, vanilla_diloco)

GB = 1e9


# --- closed forms --------------------------------------------------------------------------------

def test_ratio_is_48x_at_bf16_and_192x_at_int4():
    assert A.bandwidth_ratio(24, 2, 16) == pytest.approx(48)
    assert A.bandwidth_ratio(24, 2, 4) == pytest.approx(192)
    # N and M cancel: the ratio of the two bandwidths, for any model and ring.
    for N, M in [(1e9, 8), (3e7, 2)]:
        assert A.dp_bandwidth(N, M, 0.5) / A.diloco_bandwidth(N, M, 24, 2, 0.5, 4) == pytest.approx(192)
    # T_step / T_window and the grace's share of tau steps enter linearly.
    assert A.bandwidth_ratio(24, 2, 4, T_step=1.0, T_window=0.5) == pytest.approx(384)
    assert A.bandwidth_ratio(24, 2, 4, grace=0.5) == pytest.approx(192 * 1.5 / 2)


def test_sustained_ratio_caps_tau_at_h_over_p():
    # P = H: one fragment per step, the link carries it whatever tau is.
    assert A.bandwidth_ratio(24, 2, 16, H=24) == pytest.approx(24)
    assert A.bandwidth_ratio(24, 2, 4, H=24) == pytest.approx(96)
    assert A.bandwidth_ratio(4, 2, 4, H=24) == A.bandwidth_ratio(4, 2, 4)  # H/P = 6 >= tau


def test_dp_bytes_per_step_is_ring_allreduce_in_bf16():
    for N, M in [(820352, 4), (10**9, 8), (1000, 2)]:
        assert A.dp_bytes_per_step(N, M) == pytest.approx(2 * (M - 1) / M * N * 2)
    assert A.ring_factor(1) == 0 and A.ring_factor(2) == 1


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000, 4097])
def test_payload_bytes_are_the_encoded_lengths(codec, n):
    # Every registered codec, so a new one is covered without touching this test: the model's
    # bytes are what the codec really puts on the wire for a tensor of n values.
    assert set(A.CODECS) == set(CODECS)
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    for block in (64, 128):
        wire = make_codec(codec, block=block, topk_fraction=0.01)
        payload, _ = wire.encode(x, wire.init(x.shape))
        assert A.payload_bytes(codec, n, block, 0.01) == len(payload), (codec, n, block)
        # The per-step model counts one fragment of n values at the same size.
        b = A.diloco_bytes_per_step(n, H=1, P=1, up=codec, down=codec, block=block) if n else None
        assert b is None or b.up == b.down == len(payload)


def test_wire_bits_count_block_scales():
    assert A.wire_bits("int4") == 4.5 and A.wire_bits("int8", block=32) == 9 and A.wire_bits("bf16") == 16
    assert A.wire_bits("topk", topk_fraction=0.01) == pytest.approx(0.64)


def test_diloco_bytes_per_step_by_hand():
    # 1024 values in P = 2 fragments of 512: int4 = 8 scales * 4 B + 256 B, int8 = 32 + 512 B.
    b = A.diloco_bytes_per_step(1024, H=4, P=2, up="int4", down="int8", merges_per_round=3)
    assert b.up == pytest.approx(2 / 4 * 288) and b.down == pytest.approx(2 / 4 * 544 * 3)


# --- the utilisation simulator -------------------------------------------------------------------

def one_layer(T=0.1, latency=0.0, N=1e9):
    return Workload(N, T, layers=1, datacenters=2, latency=latency)


def test_one_layer_cases_by_hand():
    w, gbps = one_layer(), 100.0
    c = 1e9 * 16 / (gbps * GB)  # seconds to all-reduce the model in bf16 over M = 2 (ring factor 1)
    assert utilisation(w, data_parallel(), gbps) == pytest.approx(0.1 / (0.1 + c))
    assert utilisation(w, vanilla_diloco(H=10), gbps) == pytest.approx(1.0 / (1.0 + c))
    # tau = 1: the sync overlaps one whole step, only what is left over stalls.
    m = Method("overlapped", H=10, tau=1, bits=16)
    assert utilisation(w, m, gbps) == pytest.approx(1.0 / (1.0 + c - 0.1))
    assert utilisation(w, m, 1e4) == pytest.approx(1.0, abs=1e-12)  # c < T: fully hidden


def test_latency_costs_two_hops_per_ring_step():
    w = Workload(1e9, 0.1, layers=8, datacenters=3, latency=0.005)  # 2 (M-1) = 4 hops = 20 ms
    assert utilisation(w, data_parallel(), 1e9) == pytest.approx(0.1 / 0.12, rel=1e-6)
    assert required_bandwidth(w, data_parallel(), 0.9) == math.inf


@pytest.mark.parametrize("method", ["dp", "vanilla", "streaming", "decoupled"])
def test_utilisation_limits_and_monotone(method):
    w = Workload(1e10, 0.8, layers=48, datacenters=8)
    m = {"dp": data_parallel(), "vanilla": vanilla_diloco(), "streaming": streaming_diloco(48),
         "decoupled": decoupled_diloco()}[method]
    assert utilisation(w, m, 1e7) == pytest.approx(1.0, abs=1e-6)
    assert utilisation(w, m, 1e-6) < 1e-3
    ys = [utilisation(w, m, g) for g in np.logspace(-3, 4, 29)]
    assert all(b >= a - 1e-12 for a, b in zip(ys, ys[1:]))
    # Steady state: more simulated periods change nothing.
    for g in (0.3, 3.0, 300.0):
        assert utilisation(w, m, g, periods=12) == pytest.approx(utilisation(w, m, g), rel=1e-9)


def test_required_bandwidth_round_trips():
    w = Workload(1e9, 0.1, layers=24, datacenters=4)
    for m in (data_parallel(), streaming_diloco(24)):
        for target in (0.5, 0.9, 0.99):
            g = required_bandwidth(w, m, target)
            assert utilisation(w, m, g) >= target > utilisation(w, m, g * (1 - 1e-3))
    # One layer, DP: target = T / (T + N*16/W) solved for W.
    g = required_bandwidth(one_layer(), data_parallel(), 0.8, rel_tol=1e-9)
    assert g == pytest.approx(1e9 * 16 / (0.1 / 0.8 - 0.1) / GB, rel=1e-6)


# --- Table 4 -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def t4():
    return table4.rows()


def test_table4_within_1_2x_per_cell(t4):
    compared = [r for r in t4 if r["paper_gbps"] is not None]
    assert len(compared) == 30
    for r in compared:
        assert 1 / 1.2 <= r["ratio"] <= 1.2, r  # docs/experiments.md#streaming-diloco-table-4 claims 1.2x; the brief asked for 1.5x
    assert table4.worst_ratio(t4) <= 1.2


def test_table4_predicts_100b_and_orders_methods(t4):
    rows = {(r["model"], r["method"], r["target"]): r["model_gbps"] for r in t4}
    for model in table4.MODELS:
        for t in table4.TARGETS:
            dp, van, st = (rows[(model, m, t)] for m in table4.METHODS)
            assert math.isfinite(dp) and dp > van > st > 0


# --- the blog's claim ----------------------------------------------------------------------------

def test_blog_claim_numbers():
    b = blog_claim(targets=(0.99,))
    assert b["claimed_ratio"] == pytest.approx(198 / 0.84)
    assert b["values_per_second"] == pytest.approx(198e9 / (1.75 * 16))
    four = next(r for r in b["formula"] if r["bits"] == 4 and r["dp_window"] == "step")
    assert four["ratio"] == pytest.approx(192) and four["sustained_ratio"] == pytest.approx(96)
    assert b["implied_bits"] == pytest.approx(24 * 2 * 16 / (198 / 0.84))
    ten = next(r for r in b["simulated"] if r["model"] == "10B")
    assert 0.5 < ten["dd_gbps"] / 0.84 < 2  # the order of the claim


# --- measured vs analytic ------------------------------------------------------------------------

def test_sends_per_learner_by_hand():
    # H = 4, P = 2: offsets 0 and 2, so sends after steps 2, 4, 6, 8; fragment 0 left at step 8,
    # so the final flush sends fragment 1 only.
    assert sends_per_learner(8, H=4, P=2, tau=0) == 5
    assert sends_per_learner(8, H=4, P=2, tau=0, final_sync=False) == 4
    # tau = 2: sends at steps >= 8 - 2 are in flight or applied as training ends: no flush.
    assert sends_per_learner(8, H=4, P=2, tau=2) == 4
    assert sends_per_learner(7, H=4, P=2, tau=2) == 3 + 1  # steps 2, 4, 6; fragment 0 flushed


def fake_run(tmp_path, **summary):
    config = {"run": {"steps": 8}, "fragments": {"H": 4, "count": 2, "tau": 0, "final_sync": True},
              "codec": {"up": "int4", "down": "int8", "block": 64, "topk_fraction": 0.01, "zstd_level": 0}}
    base = {"algo": "diloco", "params": 1024, "learners": 2, "merges": 10}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "summary.json").write_text(json.dumps({**base, **summary}))
    return tmp_path


def test_measured_vs_analytic_known_answer(tmp_path):
    # 5 sends of 288 B per learner, 5% headers; 10 merges of 544 B reach both learners.
    run = fake_run(tmp_path, bytes_up=int(2 * 5 * 288 * 1.05), bytes_down=10 * 544 * 2)
    m = measured_vs_analytic(run)
    assert m["sends_per_learner"] == 5 and m["merges_per_round"] == 2
    assert m["up_ratio"] == pytest.approx(1.05) and m["down_ratio"] == pytest.approx(1.0)
    assert m["analytic_up"] == pytest.approx(5 * 288 / 8) and m["analytic_down"] == pytest.approx(10 * 544 / 8)
    assert m["dp"] == 2048  # 2 (M-1)/M * N * 2 bytes with M = 2
    assert m["dp_over_total"] == pytest.approx(2 * 2048 / ((3024 + 10880) / 16))  # bytes / (M * steps)
    assert m["schedule_up"] == pytest.approx(144)


def test_measured_vs_analytic_refuses_runs_without_a_ledger(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"algo": "diloco", "eval_loss": 2.4}))
    with pytest.raises(ValueError, match="config.yaml"):
        measured_vs_analytic(tmp_path)
    fake_run(tmp_path)  # summary lacks bytes_up / bytes_down
    (tmp_path / "summary.json").write_text(json.dumps({"algo": "diloco", "params": 10, "learners": 2}))
    with pytest.raises(ValueError, match="bytes_up"):
        measured_vs_analytic(tmp_path)


# --- bad inputs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("call, words", [
    (lambda: A.ring_factor(0), ["M", "0"]),
    (lambda: A.dp_bandwidth(-1, 8, 1.0), ["N", "-1"]),
    (lambda: A.dp_bandwidth(1e9, 8, 0.0), ["T_window", "0.0"]),
    (lambda: A.diloco_bandwidth(1e9, 8, 24, 2, 1.0, 4, grace=2.5), ["grace", "2.5"]),
    (lambda: A.wire_bits("int3"), ["int3"]),
    (lambda: A.diloco_bytes_per_step(1024, H=2, P=4), ["P=4", "H=2"]),
    (lambda: Workload(1e9, 0.1, layers=0), ["layers", "0"]),
    (lambda: Workload(1e9, float("nan"), layers=4), ["step_time", "nan"]),
    (lambda: Workload(1e9, 0.1, layers=4, datacenters=1), ["datacenters", "1"]),
    (lambda: Method("m", H=4, P=8), ["P=8", "H=4"]),
    (lambda: utilisation(Workload(1e9, 0.1, 12), decoupled_diloco(), 1.0), ["P=24", "layers=12"]),
    (lambda: utilisation(Workload(1e9, 0.1, 12), data_parallel(), -3.0), ["gbps", "-3.0"]),
    (lambda: required_bandwidth(Workload(1e9, 0.1, 12), data_parallel(), 1.5), ["target", "1.5"]),
    (lambda: load_config({"scenario": {"layerz": 3}}), ["layerz"]),
    (lambda: load_config({"targets": [0.5, 2]}), ["targets", "2"]),
    (lambda: load_config({"scenario": {"layers": 12}}), ["decoupled_H=24", "layers=12"]),
])
def test_bad_inputs_name_the_value(call, words):
    with pytest.raises(ValueError) as err:
        call()
    for word in words:
        assert word in str(err.value)


def test_report_markdown_has_every_section(tmp_path):
    run = fake_run(tmp_path, bytes_up=3024, bytes_down=21760)
    cfg = load_config({"targets": [0.9], "run_dir": str(run)})
    text = markdown(build(cfg))
    for heading in ("## Formula", "## Streaming DiLoCo Table 4", "## What bandwidth", "## The blog's",
                    "## Measured vs analytic"):
        assert heading in text
