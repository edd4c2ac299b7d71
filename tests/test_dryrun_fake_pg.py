"""The dry run imports a private module of torch (its fake process group): a torch without it is one line and
exit 2, not a traceback (pyproject's torch range is the one the suite runs)."""

import json
import sys

from helpers.tiny import tiny_llama


def test_a_torch_without_the_fake_process_group_is_one_line(tmp_path, monkeypatch, capsys):
    import torch.testing._internal.distributed.fake_pg as fake_pg

    from vp_accelerate.train.cli.dryrun import dryrun_main

    monkeypatch.delattr(fake_pg, "FakeStore")  # as a torch release that moved it
    for name in ("vp_accelerate.dryrun.fake_world", "vp_accelerate.dryrun.run", "vp_accelerate.dryrun.world"):
        monkeypatch.delitem(sys.modules, name, raising=False)  # imported afresh by the command
    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_llama(64, num_layers=2).to_dict()))
    args = [str(path), "--world-size", "2", "--seq", "8", "--global-batch", "2", "--pp", "2", "--microbatches", "2"]
    assert dryrun_main(args + ["--schedule", "1f1b", "--method", "vocab-2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "torch.testing._internal.distributed.fake_pg" in lines[0], lines
    assert "torch >= 2.11" in lines[0], lines[0]
