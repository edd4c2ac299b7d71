"""`--resume` with a changed optimizer, schedule or data: refused with one line per difference, or
applied to the restored state with `--override`, so the new LR is the one trained and logged. In one process:
the preflight check on a recipe, and `resume_run` on a small run object."""

import os
from types import SimpleNamespace

import pytest
import torch

from vp_accelerate.train.cli.preflight import check_run_dirs
from vp_accelerate.train.persist import store as ckpt
from vp_accelerate.train.persist.resume_check import data_identity
from vp_accelerate.train.recipe import RecipeError, load_recipe, recipe_to_dict
from vp_accelerate.train.recipe.lr_schedule import build_scheduler
from vp_accelerate.train.run.optim import build_optimizer
from vp_accelerate.train.run.run_state import resume_run
from vp_accelerate.train.run.state_parts import rank_state

CHANGED = ["optimizer.lr=1e-6", "optimizer.weight_decay=0.5", "lr.decay=constant"]


def recipe_of(tmp_path, sets=()):
    data = tmp_path / "d.txt"
    if not data.exists():
        data.write_text("some text to train on\n" * 10)
    path = tmp_path / "r.yaml"
    path.write_text(
        f"data:\n  files: [{data}]\noptimizer:\n  lr: 3.0e-3\nlr:\n  warmup_steps: 0\ntrain:\n  steps: 10\n"
        f"logging:\n  output_dir: {tmp_path / 'out'}\n  wandb_mode: disabled\n"
    )
    return load_recipe(str(path), list(sets))


class Pipe(torch.nn.Module):
    """One rank holding the whole (tiny) model, as the state parts see a pipeline (`run/state_parts.py`)."""

    rank = pp_rank = dp_rank = 0
    mods = SimpleNamespace(sharded_names=(), tp_sliced={}, tp_packed={}, tp_vocab_names=())

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(4, 4)

    def precision_state_dict(self):
        return {}

    def load_precision_state_dict(self, state):
        pass

    def make_optimizer(self, param_groups, optimizer_class, **defaults):
        return optimizer_class(param_groups, **defaults)


def make_run(recipe):
    pipe = Pipe()
    optimizer = build_optimizer(pipe, recipe.optimizer)
    it = SimpleNamespace(state={}, load_state_dict=lambda s: it.state.update(s), state_dict=lambda: {"at": 0})
    return SimpleNamespace(
        pipe=pipe,
        recipe=recipe,
        recipe_dict=recipe_to_dict(recipe),
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, recipe.lr, recipe.train.steps),
        fingerprint={"model": "m"},
        layout=None,
        train_it=it,
        counters={},
        best={},
    )


def train_and_save(recipe, steps=3):
    run = make_run(recipe)
    for _ in range(steps):
        run.pipe.w(torch.ones(2, 4)).sum().backward()
        run.optimizer.step()
        run.scheduler.step()
    ckpt.save_checkpoint(
        ckpt.SaveSpec(recipe.checkpoint.resolved_dir(recipe.logging.output_dir), steps, 0),
        rank_state(
            run,
            steps,
            {
                "fingerprint": run.fingerprint,
                "recipe": run.recipe_dict,
                "data": data_identity(recipe.data),
                "ranks": [{"rank": 0, "pp_rank": 0, "dp_rank": 0}],
            },
        ),
        lambda: None,
    )
    return run


def resumed(recipe, override=()):
    run = make_run(recipe)
    run.recipe = SimpleNamespace(**vars(recipe))
    run.recipe.checkpoint = SimpleNamespace(dir=recipe.checkpoint.resolved_dir(recipe.logging.output_dir))
    return run, resume_run(run, "latest", override)


def test_a_changed_optimizer_is_refused_with_one_line_per_difference(tmp_path):
    train_and_save(recipe_of(tmp_path))
    with pytest.raises(RecipeError) as e:
        check_run_dirs(recipe_of(tmp_path, CHANGED), "latest")
    lines = str(e.value).splitlines()
    for key, old, new in [("optimizer.lr", 0.003, 1e-06), ("optimizer.weight_decay", 0.0, 0.5)]:
        assert any(key in line and repr(new) in line for line in lines), lines
    assert any("lr.decay" in line and "'constant'" in line for line in lines)
    assert "--resume --override optimizer" in lines[-1]
    with pytest.raises(RecipeError, match="optimizer.lr"):
        resumed(recipe_of(tmp_path, CHANGED))  # the run itself refuses too (the Python API has no preflight)


def test_override_applies_the_new_values_to_the_restored_state(tmp_path):
    saved = train_and_save(recipe_of(tmp_path))
    assert check_run_dirs(recipe_of(tmp_path, CHANGED), "latest", ("optimizer",))
    run, step = resumed(recipe_of(tmp_path, CHANGED), ("optimizer",))
    assert step == 3 and run.scheduler.get_last_lr() == pytest.approx([1e-6] * len(run.optimizer.param_groups))
    assert run.optimizer.param_groups[0]["weight_decay"] == 0.5
    moments = run.optimizer.state_dict()["state"][0]["exp_avg"]  # the restored moments are kept
    assert torch.equal(moments, saved.optimizer.state_dict()["state"][0]["exp_avg"])
    assert run.scheduler.last_epoch == 3


def test_resume_with_the_same_settings_restores_the_lr(tmp_path):
    saved = train_and_save(recipe_of(tmp_path))
    run, _ = resumed(recipe_of(tmp_path))
    assert run.scheduler.get_last_lr() == saved.scheduler.get_last_lr()


def test_changed_data_is_refused_unless_overridden(tmp_path):
    train_and_save(recipe_of(tmp_path))
    data = tmp_path / "d.txt"
    st = os.stat(data)
    data.write_text("other text to train on\n" * 10)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))  # the mtime kept: the content tells
    with pytest.raises(RecipeError) as e:
        check_run_dirs(recipe_of(tmp_path), "latest")
    assert f"data.files: {data} changed since the checkpoint" in str(e.value) and "--override data" in str(e.value)
    assert check_run_dirs(recipe_of(tmp_path), "latest", ("data",))


def _resume_with_one_rank_damaged(root: str, damaged_rank: int):
    """Two ranks save, one rank's optimizer.pt is cut short, both resume: every rank must raise the same
    error naming the file, and none may have said "resumed" (nor loaded anything)."""
    import logging

    import torch.distributed as dist

    from vp_accelerate.train.run.tracking import gather

    rank = dist.get_rank()
    data = os.path.join(root, "d.txt")
    if rank == 0:
        with open(data, "w") as f:
            f.write("text\n")
    dist.barrier()
    pipe = Pipe()
    pipe.rank = rank
    opt = torch.optim.AdamW(pipe.parameters())
    cfg = SimpleNamespace(hub_id=None, files=[data], eval_files=[])
    ckpt.save_checkpoint(
        ckpt.SaveSpec(root, 4, rank),
        ckpt.RankState(
            pipe.state_dict(),
            opt.state_dict(),
            {"scheduler": {}, "rng": ckpt.rng_state(), "data": {}},
            {"fingerprint": {}, "recipe": {}, "data": data_identity(cfg)},
        ),
        dist.barrier,
        agree=gather,
    )
    if rank == damaged_rank:
        target = os.path.join(root, "step_00000004", ckpt.rank_dir_name(rank), "optimizer.pt")
        os.truncate(target, os.path.getsize(target) // 2)
    dist.barrier()
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("vp_accelerate.train").addHandler(handler)
    logging.getLogger("vp_accelerate.train").setLevel(logging.INFO)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    run = SimpleNamespace(
        pipe=pipe,
        recipe=SimpleNamespace(checkpoint=SimpleNamespace(dir=root), data=cfg),
        recipe_dict={},
        optimizer=opt,
        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        fingerprint={},
        layout=None,
        train_it=None,
        counters={},
        best={},
    )
    try:
        resume_run(run, "latest")
        error = None
    except ckpt.CheckpointError as e:
        error = str(e)
    unchanged = all(torch.equal(before[k], v) for k, v in pipe.state_dict().items())
    return error, [m for m in said if "resumed" in m], unchanged


@pytest.mark.parametrize("damaged_rank", [0, 1])
def test_a_damaged_file_on_one_rank_stops_every_rank_before_resumed(tmp_path, damaged_rank):
    from vp_accelerate.distributed import spawn

    results = spawn(_resume_with_one_rank_damaged, 2, str(tmp_path), damaged_rank, timeout_s=120)
    name = os.path.join(str(tmp_path), "step_00000004", ckpt.rank_dir_name(damaged_rank), "optimizer.pt")
    for error, resumed_lines, unchanged in results:
        assert error is not None and name in error and "were saved" in error, error
        assert resumed_lines == [] and unchanged


def test_override_optimizer_applies_every_hyperparameter_of_the_run():
    """`--override optimizer` takes every key of this run's parameter groups, not a hand-kept list: a
    hyperparameter outside the old list of five (here `amsgrad`) is this run's after the resume too."""
    import torch

    from vp_accelerate.train.persist import resume_check

    p = torch.nn.Parameter(torch.zeros(2))
    run = torch.optim.AdamW([p], lr=0.1, weight_decay=0.5, amsgrad=True)
    sched = torch.optim.lr_scheduler.LambdaLR(run, lambda s: 1.0)
    fresh = resume_check.fresh_hyperparameters(run, sched)
    saved = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.3, weight_decay=0.0, amsgrad=False)
    run.load_state_dict(saved.state_dict())  # the restored state brings the checkpoint's hyperparameters
    assert run.param_groups[0]["amsgrad"] is False
    resume_check.apply_hyperparameters(run, sched, fresh)
    group = run.param_groups[0]
    assert (group["amsgrad"], group["weight_decay"], group["lr"]) == (True, 0.5, 0.1)


def test_every_optimizer_key_reaches_what_override_applies():
    """Each field of the recipe's optimizer section is either a parameter-group value of the built optimizer
    (what `fresh_hyperparameters` carries, so `--override optimizer` applies it) or one of `NOT_RESTORED` (read
    from the recipe at every step): a new key cannot keep the checkpoint's value unnoticed."""
    import dataclasses

    from vp_accelerate.train.persist.resume_check import NOT_RESTORED, fresh_hyperparameters
    from vp_accelerate.train.recipe.schema import OptimizerSection

    params = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]
    pipe = SimpleNamespace(
        named_parameters=lambda: [("w", params[0]), ("b", params[1])],
        make_optimizer=lambda groups, cls, **kw: cls(groups, **kw),
    )

    def groups(cfg):
        return fresh_hyperparameters(build_optimizer(pipe, cfg), None)["groups"]

    base = OptimizerSection()
    fields = {f"optimizer.{f.name}" for f in dataclasses.fields(OptimizerSection)}
    assert NOT_RESTORED <= fields, "NOT_RESTORED names a key the optimizer section does not have"
    for f in dataclasses.fields(OptimizerSection):
        if f"optimizer.{f.name}" in NOT_RESTORED:
            continue
        value = getattr(base, f.name)
        other = [v / 2 for v in value] if isinstance(value, list) else value / 2
        assert groups(dataclasses.replace(base, **{f.name: other})) != groups(base), f.name
