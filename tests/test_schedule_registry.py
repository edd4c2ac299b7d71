"""The schedule / method registry: one source for names, capabilities and the allowed values everywhere."""

import argparse
import json

import pytest

from vp_accelerate.runtime.pipeline import PipelineConfig
from vp_accelerate.schedule import Op, ScheduleError, build_schedule, validate
from vp_accelerate.schedule.registry import (
    METHODS,
    SCHEDULES,
    argparse_type,
    method,
    normalise_method,
    normalise_schedule,
    schedule_kind,
    supported_pairs,
)
from vp_accelerate.sim.commands import simulate_main
from vp_accelerate.train.recipe import RecipeError, recipe_from_dict


@pytest.mark.parametrize("kind,meth", supported_pairs())
def test_every_registered_pair_builds_and_follows_its_entries(kind, meth):
    sk, m = SCHEDULES[kind], METHODS[meth]
    for forward_only in (False, True):
        s = build_schedule(kind, meth, 3, 6, forward_only=forward_only)
        validate(s)
        assert s.method is m and s.kind is sk and (str(s.kind), str(s.method)) == (kind, meth)
        assert s.num_chunks == 3 * (sk.chunks_per_rank or sk.default_chunks_per_rank)
        assert s.split_backward == (sk.split_backward and not forward_only)
        ops = {a.op for rank in s.actions for a in rank}
        assert s.vocab_parallel == m.vocab_parallel == (Op.S in ops)
        # the second barrier (C2) exists exactly for the two-barrier method, and only with a backward
        assert (Op.C2 in ops) == (m.barriers == 2 and not forward_only)


def test_pairs_cover_every_method_and_reject_the_rest():
    assert {m for _, m in supported_pairs()} == set(METHODS)
    for kind, sk in SCHEDULES.items():
        for meth in set(METHODS) - set(sk.methods):
            with pytest.raises(ScheduleError, match=f"does not support method '{meth}'.*use "):
                build_schedule(kind, meth, 4, 8)


def test_method_entries_imply_the_output_layer():
    for m in METHODS.values():
        assert (m.output_algorithm is not None) == m.vocab_parallel == (m.barriers > 0)
        assert m.grad_barrier == {0: None, 1: Op.C1, 2: Op.C2}[m.barriers]
    assert METHODS["vocab-1"].input_grad_in_t and not METHODS["vocab-2"].input_grad_in_t
    assert [m for m in METHODS if METHODS[m].balanced_layers] == ["redis"]


def test_names_are_case_insensitive():
    assert schedule_kind("1F1B") is SCHEDULES["1f1b"] and method(" Vocab-2 ") is METHODS["vocab-2"]
    assert normalise_schedule("VHalf") == "vhalf" and normalise_method("BASELINE") == "baseline"
    a, b = build_schedule("Interleaved", "VOCAB-2", 2, 4), build_schedule("interleaved", "vocab-2", 2, 4)
    assert a == b and a.kind.name == "interleaved" and a.method.name == "vocab-2"
    cfg = PipelineConfig(schedule="1F1B", method="Vocab-1")
    assert (cfg.schedule, cfg.method) == ("1f1b", "vocab-1")


@pytest.mark.parametrize(
    "call,message",
    [
        (
            lambda: schedule_kind("1f1bb"),
            r"unknown schedule kind '1f1bb'; choose one of 1f1b, vhalf, interleaved; "
            r"did you mean '1f1b'\?",
        ),
        (
            lambda: method("vocab2"),
            r"unknown method 'vocab2'; choose one of baseline, redis, vocab-1, vocab-2, interlaced; "
            r"did you mean 'vocab-2'\?",
        ),
        (lambda: method("zzz"), r"unknown method 'zzz'; choose one of baseline, redis, vocab-1, vocab-2, interlaced$"),
        (lambda: schedule_kind(None), r"unknown schedule kind None"),
        (lambda: PipelineConfig(method="Vocab2"), r"did you mean 'vocab-2'"),
        (lambda: build_schedule("zb", "baseline", 4, 8), r"unknown schedule kind 'zb'"),
    ],
)
def test_unknown_names_list_the_valid_ones(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_recipe_and_cli_take_their_names_from_the_registry(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "hello"}) + "\n")
    data = {"data": {"files": [str(corpus)]}, "tokenizer": {"source": "qwen"}}
    r = recipe_from_dict({**data, "pipeline": {"schedule": "VHALF", "method": "Vocab-1"}})
    assert (r.pipeline.schedule, r.pipeline.method) == ("vhalf", "vocab-1")
    with pytest.raises(
        RecipeError,
        match="pipeline.method: expected one of 'baseline', 'redis', 'vocab-1', "
        "'vocab-2', 'interlaced', got 'vocab2'; did you mean 'vocab-2'",
    ):
        recipe_from_dict({**data, "pipeline": {"method": "vocab2"}})

    parse = argparse_type(normalise_method)
    assert parse("Vocab-2") == "vocab-2"
    with pytest.raises(argparse.ArgumentTypeError, match="did you mean 'redis'"):
        parse("rediss")
    shape = ["--hidden", "256", "--layers", "8", "--heads", "4", "--vocab", "1000", "--seq", "128"]
    assert (
        simulate_main(
            shape + ["--pp", "2", "--microbatches", "4", "--schedule", "VHALF", "--method", "Vocab-1", "--json"]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["schedule"] == "vhalf"
    with pytest.raises(SystemExit):
        simulate_main(shape + ["--pp", "2", "--microbatches", "4", "--schedule", "zb"])
    assert "unknown schedule kind 'zb'; choose one of 1f1b, vhalf, interleaved" in capsys.readouterr().err
