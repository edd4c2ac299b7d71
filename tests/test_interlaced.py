"""The interlaced pipeline (`method: interlaced`, the paper's fifth column): the vocabulary layers sharded over the
pipeline group like vocab-1's, every vocabulary step run synchronously by all ranks between the pipeline passes,
and about 1.5p microbatches of activations in flight on the first rank. Its exactness against HF is in
test_runtime_exact.py (every registered schedule x method); here: the order, the memory, the refusals."""

from __future__ import annotations

import pytest

from vp_accelerate.models.tensor_parallel import TPError
from vp_accelerate.runtime import PipelineConfig
from vp_accelerate.runtime.tensor_parallel import check_layout
from vp_accelerate.schedule import ScheduleError, build_schedule
from vp_accelerate.schedule.ir import CHUNK_PASSES, P2P, Op
from vp_accelerate.schedule.validate import validate

VOCAB_STEP = {Op.S, Op.T, Op.IF, Op.IB, Op.C1, Op.IF_REDUCE, Op.IB_BCAST}


def _peak_in_flight(actions) -> int:
    held = peak = 0
    for a in actions:
        held += (a.op is Op.F) - (a.op is Op.B)
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_every_vocabulary_step_is_synchronous(p):
    """On every rank, nothing but vocabulary work runs between C0(k) and C2(k) (the last stage's F(k) done, its
    B(k) not started): all ranks stop together for the output layer, with the input embedding's passes beside it."""
    for m in (p, 2 * p + 1):
        for forward_only in (False, True):
            s = build_schedule("1f1b", "interlaced", p, m, forward_only=forward_only)
            validate(s)
            end = Op.C1 if forward_only else Op.C2
            for r, actions in enumerate(s.actions):
                inside = False
                for a in actions:
                    if a.op is Op.C0:
                        inside = True
                    elif a.op is end:
                        inside = False
                    elif inside:
                        assert a.op in VOCAB_STEP, (p, m, r, str(a))
                        assert a.op not in CHUNK_PASSES and a.op not in P2P


@pytest.mark.parametrize("p", [2, 4, 8])
def test_the_first_rank_holds_one_and_a_half_p_microbatches(p):
    """1F1B holds p microbatches on rank 0, vocab-2 p + 1, vocab-1 p + 2, the interlaced pipeline 1.5p: its
    gradient moves one stage per period around the synchronous steps."""
    m = 4 * p
    peak = {
        meth: _peak_in_flight(build_schedule("1f1b", meth, p, m).actions[0])
        for meth in ("baseline", "vocab-2", "vocab-1", "interlaced")
    }
    assert peak == {"baseline": p, "vocab-2": p + 1, "vocab-1": p + 2, "interlaced": 3 * p // 2}
    last = _peak_in_flight(build_schedule("1f1b", "interlaced", p, m).actions[p - 1])
    assert last == 1


def test_the_cost_aware_builder_keeps_the_steps_synchronous():
    from vp_accelerate.cost import ModelShape, for_schedule

    grid = build_schedule("1f1b", "interlaced", 4, 8)
    shape = ModelShape(hidden=256, layers=8, heads=4, ffn=1024, vocab=32000, seq=256)
    costs = for_schedule(shape, grid)
    assert build_schedule("1f1b", "interlaced", 4, 8, costs=costs).actions == grid.actions


def test_what_interlaced_does_not_run_is_refused_in_one_line():
    for kind in ("vhalf", "interleaved"):
        with pytest.raises(ScheduleError, match=f"schedule '{kind}' does not support method 'interlaced'.*1f1b"):
            build_schedule(kind, "interlaced", 4, 8)
    with pytest.raises(TPError, match=r"method interlaced .* use method vocab-2"):
        check_layout(PipelineConfig(method="interlaced", tp_size=2))


def _checkpoint_on_ranks(ckpt: str, out: str, ids):
    import torch

    from vp_accelerate.runtime import PipelineModel

    def pipe(method):
        return PipelineModel(ckpt, PipelineConfig(schedule="1f1b", method=method, microbatches=4), dtype=torch.float64)

    trained = pipe("vocab-1")
    opt = torch.optim.SGD(trained.parameters(), lr=0.5)
    trained.train_step(ids, ids.clone())
    opt.step()
    saved = {k: v.clone() for k, v in trained.state_dict().items()}
    trained.close()
    resumed = pipe("interlaced")  # the same rows of both vocabulary matrices on each rank: loads as saved
    resumed.load_state_dict(saved)
    same = {k: torch.equal(v, saved[k]) for k, v in resumed.state_dict().items()} == {k: True for k in saved}
    loss = resumed.train_step(ids, ids.clone()).loss
    resumed.export_hf(out)
    resumed.close()
    return same, loss


@pytest.mark.slow
def test_a_vocab_1_checkpoint_resumes_as_interlaced_and_exports(tmp_path):
    """Both shard the vocabulary the same way (V/p rows each, the vocabulary not divisible by p here): a
    checkpoint of one loads into the other, and the interlaced run exports the HF model it trained."""
    import torch
    from transformers import AutoModelForCausalLM

    from helpers.tiny import tiny_llama
    from vp_accelerate.distributed import spawn

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama(101, tied=True, attn_implementation="eager"))
    model.save_pretrained(tmp_path / "hf")
    ids = torch.randint(0, 101, (4, 8))
    results = spawn(_checkpoint_on_ranks, 2, str(tmp_path / "hf"), str(tmp_path / "out"), ids, timeout_s=300)
    assert all(same for same, _ in results)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64, attn_implementation="eager")
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    with torch.no_grad():
        want = ref(input_ids=ids, labels=ids).loss.item()
    assert results[0][1] == pytest.approx(want, rel=1e-6)  # HF float64 runs its norms and softmax in float32
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64)
    assert exported.config.vocab_size == 101
