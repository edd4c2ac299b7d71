"""The simulate / plot-schedule commands and the timeline plotter's input formats."""

import json

from vp_accelerate.sim.commands import plot_schedule_main, simulate_main
from vp_accelerate.sim.plot import plot_timeline

SHAPE = ["--hidden", "3072", "--layers", "32", "--heads", "24", "--seq", "2048"]


def test_simulate_json(capsys):
    assert simulate_main(SHAPE + ["--vocab", "128000", "--pp", "8", "--microbatches", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"step_time", "mfu", "bubble_rate"} <= out.keys()
    assert len(out["ranks"]) == 8
    assert {"peak_activation_microbatches", "peak_memory_bytes"} <= out["ranks"][0].keys()
    assert 0.3 < out["mfu"] < 0.6


def test_simulate_under_nccl_rules_is_never_faster(capsys):
    args = SHAPE + ["--vocab", "256000", "--pp", "4", "--microbatches", "16", "--schedule", "vhalf", "--json"]
    steps = {}
    for rules in ("buffered", "nccl", "nccl-serialized"):
        assert simulate_main(args + ["--p2p", rules]) == 0
        steps[rules] = json.loads(capsys.readouterr().out)["step_time"]
    assert steps["buffered"] <= steps["nccl"] * (1 + 1e-12) <= steps["nccl-serialized"] * (1 + 1e-12)


def test_simulate_reports_bad_input(capsys):
    assert simulate_main(SHAPE + ["--vocab", "1000", "--pp", "8", "--microbatches", "4"]) == 2
    assert "num_microbatches" in capsys.readouterr().err


def test_plot_schedule(tmp_path):
    out = tmp_path / "t.png"
    assert (
        plot_schedule_main(
            SHAPE
            + [
                "--vocab",
                "64000",
                "--pp",
                "4",
                "--microbatches",
                "8",
                "--schedule",
                "vhalf",
                "--method",
                "vocab-1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert out.stat().st_size > 1000


def test_plot_timeline_accepts_plain_records(tmp_path):
    recs = [{"rank": 0, "op": "F", "mb": 0, "chunk": 0, "start": 0.0, "end": 1.0}, (1, "B", 0, 1, 1.0, 3.0)]
    per_rank = [[recs[0]], [recs[1]]]
    for i, data in enumerate((recs, per_rank)):
        plot_timeline(data, tmp_path / f"{i}.png", title="x")
        assert (tmp_path / f"{i}.png").exists()


def test_simulate_prices_held_sms_and_the_softmax_bytes(capsys):
    """--comm-sm-fraction slows VP (its collectives hold SMs), not the baseline (none); --logit-bytes makes
    the baseline's softmax dearer. (New flags: fails on a simulator without them.)"""

    def mfu(method, *extra):
        args = SHAPE + ["--vocab", "128000", "--pp", "4", "--microbatches", "8", "--method", method, "--json"]
        assert simulate_main(args + list(extra)) == 0
        return json.loads(capsys.readouterr().out)["mfu"]

    assert mfu("vocab-2", "--comm-sm-fraction", "0.2") < mfu("vocab-2") * 0.99
    assert mfu("baseline", "--comm-sm-fraction", "0.2") == mfu("baseline")
    assert mfu("baseline", "--logit-bytes", "26") < mfu("baseline") * 0.99
    assert (
        simulate_main(SHAPE + ["--vocab", "128000", "--pp", "4", "--microbatches", "8", "--comm-sm-fraction", "1"]) == 2
    )
    assert "--comm-sm-fraction" in capsys.readouterr().err
