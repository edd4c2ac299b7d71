"""The streaming HF export (models/stream_export.py): each pipeline rank of replica 0 writes its own decoder
layers to its own safetensors file, the vocabulary matrices are put together one at a time (padding cut),
and `from_pretrained` reads back exactly the model that was loaded (the reference: the HF checkpoint the
pipeline was built from), in the parameters' dtype or the one asked for; the offline export of per-rank
files (a checkpoint's) writes the same directory."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from helpers.tiny import tiny_llama
from vp_accelerate.distributed import spawn

CONFIGS = [("vocab-2", False), ("baseline", True)]  # two sharded matrices; a tied copy on two ranks


def _run(ckpts, out):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    infos = []
    for i, (method, _) in enumerate(CONFIGS):
        pipe = PipelineModel(ckpts[i], PipelineConfig(schedule="1f1b", method=method, microbatches=2, dp_size=2))
        pipe.export_hf(f"{out}/{i}/live")
        if i == 0:
            pipe.export_hf(f"{out}/{i}/bf16", dtype=torch.bfloat16)
        if pipe.dp_rank == 0:  # a checkpoint's rank file: this rank's tensors as it holds them
            sd = {n: t.contiguous() for n, t in pipe.mods.state_dict().items()}
            save_file(sd, f"{out}/{i}/rank{pipe.pp_rank}.safetensors")
        dups = sorted(n for n, _ in pipe.named_parameters() if pipe.mods.is_duplicate(n))
        info = (pipe.pp_rank, pipe.dp_rank, dups, sorted(pipe.mods.sharded_names))
        pipe.close()
        infos.append(info)
    return infos


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream_export")
    torch.manual_seed(random.randrange(2**31))
    ckpts = []
    for i, (_, tied) in enumerate(CONFIGS):
        path = str(d / f"ckpt{i}")
        AutoModelForCausalLM.from_config(tiny_llama(101, tied=tied, num_layers=4)).save_pretrained(path)
        ckpts.append(path)
    per_rank = spawn(_run, 4, ckpts, str(d), timeout_s=300)
    return d, ckpts, per_rank


def _same(a: str, b: str, dtype=None):
    want = AutoModelForCausalLM.from_pretrained(a).state_dict()
    got = AutoModelForCausalLM.from_pretrained(b, dtype="auto").state_dict()
    assert set(want) == set(got)
    for name, t in want.items():
        t = t.to(dtype) if dtype is not None else t
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), name


def test_live_export_is_the_loaded_model_one_file_per_rank(exported):
    d, ckpts, _ = exported
    for i in range(len(CONFIGS)):
        _same(ckpts[i], str(d / f"{i}" / "live"))
        index = json.loads((d / f"{i}" / "live" / "model.safetensors.index.json").read_text())["weight_map"]
        files = sorted(set(index.values()))
        assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], files
        # 1f1b on 2 ranks of 4 layers: rank 0 writes layers 0-1, rank 1 layers 2-3 and the final norm
        for name, file in index.items():
            if name.startswith("model.layers."):
                layer = int(name.split(".")[2])
                assert file == files[layer // 2], (name, file)
        with safe_open(str(d / f"{i}" / "live" / files[0]), "pt") as f:  # the files hold what the index says
            assert sorted(f.keys()) == sorted(n for n, file in index.items() if file == files[0])


def test_export_in_another_dtype(exported):
    d, ckpts, _ = exported
    _same(ckpts[0], str(d / "0" / "bf16"), torch.bfloat16)
    cfg = json.loads((d / "0" / "bf16" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"


def test_offline_export_of_rank_files_is_the_same_model(exported):
    from transformers import AutoConfig

    from vp_accelerate.models.stream_export import export_rank_files

    d, ckpts, per_rank = exported
    for i in range(len(CONFIGS)):
        replica0 = sorted((r[i] for r in per_rank if r[i][1] == 0), key=lambda r: r[0])
        files = [(str(d / f"{i}" / f"rank{pp}.safetensors"), frozenset(dups)) for pp, _, dups, _ in replica0]
        out = d / f"{i}" / "offline"
        export_rank_files(files, 101, replica0[0][3], AutoConfig.from_pretrained(ckpts[i]), out)
        _same(ckpts[i], str(out))
        out16 = d / f"{i}" / "offline16"
        export_rank_files(files, 101, replica0[0][3], AutoConfig.from_pretrained(ckpts[i]), out16, dtype=torch.float16)
        _same(ckpts[i], str(out16), torch.float16)


# ---- under tensor parallelism: a stage's TP rank 0 writes the stage's file, the slices joined one tensor at a time
TP_CONFIGS = [("vocab-2", False), ("baseline", True)]  # the vocabulary over pp x tp; the end layers split over TP


def _run_tp(ckpts, out):
    from vp_accelerate.runtime import PipelineConfig, PipelineModel
    from vp_accelerate.train.persist.hf_export import tp_layout

    infos = []
    for i, (method, _) in enumerate(TP_CONFIGS):
        pipe = PipelineModel(ckpts[i], PipelineConfig(schedule="1f1b", method=method, microbatches=2, tp_size=2))
        pipe.export_hf(f"{out}/tp{i}/live")
        sd = {n: t.contiguous() for n, t in pipe.mods.state_dict().items()}  # a checkpoint's rank file
        save_file(sd, f"{out}/tp{i}/rank{pipe.rank}.safetensors")
        dups = sorted(n for n, _ in pipe.named_parameters() if pipe.mods.is_duplicate(n))
        m = pipe.mods
        meta = {"tp_size": 2, "tp_sliced": m.tp_sliced, "tp_packed": m.tp_packed, "tp_vocab": sorted(m.tp_vocab_names)}
        infos.append((pipe.rank, dups, sorted(m.sharded_names), tp_layout(meta)))
        pipe.close()
    return infos


@pytest.mark.slow
def test_tp_export_streams_one_file_per_stage(tmp_path):
    """pp 2 x tp 2: the live export and the offline export of the rank files are the loaded model, one file per
    pipeline stage (before: tensor parallelism gathered the whole model on one rank and saved it whole)."""
    from transformers import AutoConfig

    from vp_accelerate.models.stream_export import TPLayout, export_rank_files

    torch.manual_seed(random.randrange(2**31))
    ckpts = []
    for i, (_, tied) in enumerate(TP_CONFIGS):
        path = str(tmp_path / f"ckpt{i}")
        AutoModelForCausalLM.from_config(tiny_llama(101, tied=tied, num_layers=4)).save_pretrained(path)
        ckpts.append(path)
    per_rank = spawn(_run_tp, 4, ckpts, str(tmp_path), timeout_s=300)
    for i in range(len(TP_CONFIGS)):
        live = tmp_path / f"tp{i}" / "live"
        _same(ckpts[i], str(live))
        index = json.loads((live / "model.safetensors.index.json").read_text())["weight_map"]
        assert sorted(set(index.values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        ranks = sorted((r[i] for r in per_rank), key=lambda r: r[0])
        sliced = {n: d for r in ranks for n, d in r[3].sliced.items()}
        tp = TPLayout(2, sliced, {}, frozenset(n for r in ranks for n in r[3].vocab))
        files = [(str(tmp_path / f"tp{i}" / f"rank{r}.safetensors"), frozenset(dups)) for r, dups, _, _ in ranks]
        out = tmp_path / f"tp{i}" / "offline"
        export_rank_files(files, 101, ranks[0][2], AutoConfig.from_pretrained(ckpts[i]), out, tp=tp)
        _same(ckpts[i], str(out))
