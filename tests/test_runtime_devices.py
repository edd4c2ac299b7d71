"""Every collective on a device group (NCCL on GPUs) gets tensors on the rank's device; host-side
bookkeeping (token counts, bubble rate, non-finite flags, object gathers) stays on the gloo side groups.

Runs on CPU: tests/helpers/device_audit.py tags the tensors a GPU run would hold in host memory and
records every collective; any host tensor reaching a device group fails the test. One train / clip /
optimizer / eval / non-finite step / export cycle per schedule x method, plus the trainer's helpers.
"""

from __future__ import annotations

import math
import random

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from helpers.tiny import tiny_llama
from vp_accelerate.distributed import spawn

CONFIGS = [  # (schedule, method, dp_size)
    ("1f1b", "baseline", 1),
    ("1f1b", "redis", 1),
    ("1f1b", "vocab-1", 1),
    ("1f1b", "vocab-2", 1),
    ("vhalf", "baseline", 1),
    ("vhalf", "vocab-1", 1),
    ("vhalf", "vocab-2", 1),
    ("interleaved", "baseline", 1),
    ("interleaved", "vocab-2", 1),
]
DP_CONFIGS = [("vhalf", "vocab-2", 2)]  # 4 ranks: the token count and gradient reduce


def _cycle(ckpt: str, out_dir: str, seed: int, vocab: int, configs):
    from helpers.device_audit import CollectiveAudit, audit
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.train.run.nonfinite import check_weights_before_save
    from vp_accelerate.train.run.tracking import gather

    report = {}
    for schedule, method, dp in configs:
        key = f"{schedule}/{method}/dp{dp}"
        with CollectiveAudit(torch.device("cpu"), []) as built:  # construction: host groups not known yet
            pipe = PipelineModel(
                ckpt,
                PipelineConfig(
                    schedule=schedule, method=method, microbatches=2, dp_size=dp, attn_implementation="eager"
                ),
            )
        g = pipe.groups
        backends = [dist.get_backend(h) for h in (g.host_group, g.pp_host_group, g.dp_host_group) if h is not None]
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
        with audit(pipe.device, [g.host_group, g.pp_host_group, g.dp_host_group]) as rec:  # dp's: None at dp 1
            gen = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, vocab, (4, 8), generator=gen)  # host-born, as a data loader's batch
            labels = ids.clone()
            labels[0, 5:] = -100
            rows = slice(pipe.dp_rank * 4 // dp, (pipe.dp_rank + 1) * 4 // dp)
            res = pipe.train_step(ids[rows], labels[rows])
            norm = pipe.clip_grad_norm_(1.0)
            opt.step()
            pipe.zero_grad()
            eval_loss = pipe.eval_step(ids[rows], labels[rows])
            lines = gather(pipe.describe())
            check_weights_before_save(1, pipe.state_dict(), opt.state_dict())
            with torch.no_grad():  # a NaN weight: the step names its microbatches through a collective
                pipe.parameters()[0].fill_(float("nan"))
            bad = pipe.train_step(ids[rows], labels[rows])
            pipe.clip_grad_norm_(1.0)
            pipe.zero_grad()
            pipe.export_hf(f"{out_dir}/{key.replace('/', '_')}")
        pipe.close()
        report[key] = {
            "problems": built.problems() + rec.problems(),
            "backends": backends,
            "groups_used": sorted({r["group"] for r in rec.records}),
            "n": len(rec.records),
            "finite": math.isfinite(res.loss) and math.isfinite(norm) and math.isfinite(eval_loss),
            "nonfinite_found": bool(bad.nonfinite_microbatches),
            "lines": len(lines),
        }
    return report


def _check(tmp_path, world: int, configs):
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    vocab = 101
    cfg = tiny_llama(vocab, tied=True, num_layers=4)  # tied: the baseline's first/last stage gradient reduce runs
    ckpt = str(tmp_path / "ckpt")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(ckpt)
    per_rank = spawn(_cycle, world, ckpt, str(tmp_path / "export"), seed, vocab, configs, timeout_s=600)
    for rank, report in enumerate(per_rank):
        for key, r in report.items():
            assert r["problems"] == [], f"rank {rank}, {key}:\n" + "\n".join(r["problems"])
            assert set(r["backends"]) == {"gloo"}, (rank, key)
            assert r["groups_used"] == ["device", "host"], (rank, key)  # the audit saw both kinds
            assert r["finite"] and r["nonfinite_found"] and r["lines"] == world, (rank, key, r)


def test_no_host_tensor_reaches_a_device_group(tmp_path):
    _check(tmp_path, 2, CONFIGS)


def test_no_host_tensor_reaches_a_device_group_with_data_parallel(tmp_path):
    _check(tmp_path, 4, DP_CONFIGS)
