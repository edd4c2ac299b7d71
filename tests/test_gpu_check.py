"""scripts/gpu_check.sh and gpu_check.py on the CPU: the whole `--cpu` tiny path with only `python3` on PATH,
the output-layer part's pass criterion (it fails when its numbers are off, not only when its subprocess
fails), the summary's honesty (world size 1 said, parts that did not run named, the paper's Table 3 as
published) and the interpreter the script picks."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vp_accelerate.distributed import spawn
from vp_accelerate.schedule.registry import supported_pairs

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("vocab_ws1", "schedules_ws1", "bf16_ws1", "output_layer_1gpu", "streams_1gpu", "quickstart_bf16")
QUICK = PARTS[:-1]  # the quickstart part starts four interpreters (corpus, tokenizer, launcher, rank): slow


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _env(path: str) -> dict:
    return {
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PATH": path,
        "HOME": os.environ.get("HOME", "/tmp"),
    }


def _other_parts(out: str, parts=QUICK[1:]) -> list[int]:
    """These parts, as the script runs each (gpu_check.main), then the summary: their exit statuses. One
    rank forked with torch and transformers imported already, not a fresh interpreter per part."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # as the script's --cpu
    gc = _module()
    return [gc.main(["--part", p, "--out", out, "--tiny"]) for p in parts] + [gc.main(["--summarize", "--out", out])]


@pytest.mark.slow  # ~19 s: every part's CPU path; the parts' own tests stay in the suite
def test_cpu_path_of_the_script_with_only_python3(tmp_path):
    """A copy of the scripts outside the repository (no .venv next to it) and a PATH whose only Python is
    `python3`: the script picks it and runs its first part in its own process under its time limit, and
    its summary names the parts that did not run; the other parts then run at their tiny size as the
    script runs each, every one passes, and the summary over all of them says what the run was."""
    scripts = tmp_path / "repo" / "scripts"
    scripts.mkdir(parents=True)
    for name in ("gpu_check.sh", "gpu_check.py", "bench_output_layer.py"):
        shutil.copy(ROOT / "scripts" / name, scripts / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    tools = [shutil.which(t) for t in ("timeout", "tail", "mkdir", "rm", "dirname")]
    for tool in tools:  # coreutils only: no `python` anywhere on this PATH
        os.symlink(tool, bin_dir / os.path.basename(tool))
    out = tmp_path / "out"
    run = subprocess.run(
        [shutil.which("bash"), str(scripts / "gpu_check.sh"), str(out), "--cpu", PARTS[0]],
        capture_output=True,
        text=True,
        env=_env(str(bin_dir)),
        timeout=900,
    )
    log = run.stdout + run.stderr + (out / f"{PARTS[0]}.log").read_text()
    assert run.stdout.splitlines()[0] == f"gpu_check: {bin_dir}/python3", log
    assert run.returncode == 1, log  # the summary's status: not every part ran
    assert json.loads((out / "results.json").read_text())[PARTS[0]]["status"] == "pass", log
    assert all(f"| {p} | not run |" in (out / "summary.md").read_text() for p in PARTS[1:])

    statuses = spawn(_other_parts, 1, str(out), timeout_s=600)[0]
    assert statuses == [0] * (len(QUICK) - 1) + [1], (out / "summary.md").read_text()  # the quickstart: not run
    results = json.loads((out / "results.json").read_text())
    ran = {p: r for p, r in results.items() if p in QUICK}
    assert set(results) == set(PARTS) and all(r["status"] == "pass" and r["tiny"] for r in ran.values()), results
    assert results["quickstart_bf16"]["status"] == "not run"
    streams = results["streams_1gpu"]
    assert len(streams["races"]) == len(supported_pairs())
    assert streams["sync_debug"]["mode"] == "off (no CUDA)" and streams["sync_debug"]["syncs"] == 0
    assert streams["sync_debug"]["checked_steps"] == len(supported_pairs())
    assert len(streams["step_time"]) == 3
    assert all(r["criterion"] and r["checks"] for r in ran.values())
    schedules = results["schedules_ws1"]
    assert schedules["backend"] == "gloo" and schedules["world_size"] == 1
    assert len(schedules["rows"]) == len(supported_pairs()) >= 9
    summary = (out / "summary.md").read_text()
    assert "Tiny sizes on the CPU" in summary and "| quickstart_bf16 | not run |" in summary
    assert f"| schedules_ws1 | pass | {len(supported_pairs())} schedule x method on gloo at world size 1" in summary


def _streams_without_time(out: str) -> int:
    os.environ.update(CUDA_VISIBLE_DEVICES="", GPU_CHECK_LIMIT_S="0")  # as gpu_check.sh sets it, all spent
    return _module().main(["--part", "streams_1gpu", "--out", out, "--tiny"])


def test_the_streams_part_out_of_time_skips_its_runs_and_still_reports(tmp_path):
    """With no time left of its limit the streams part starts no schedule x method model (it used to start
    all of them and be killed by its limit with no JSON), names what it skipped, still measures the step
    time, and writes its figures."""
    assert spawn(_streams_without_time, 1, str(tmp_path), timeout_s=300)[0] == 1
    result = json.loads((tmp_path / "streams_1gpu.json").read_text())
    assert result["status"] == "fail" and result["races"] == [] and len(result["step_time"]) == 3, result
    assert result["why"].startswith("out of time, not run: 1f1b/baseline float64, "), result["why"]
    assert result["sync_debug"]["checked_steps"] == 0
    assert "races: 0 steps" in _module()._one_line("streams_1gpu", result)


def _streams_killed_after_one_model(out: str) -> None:
    """The streams part as a kill by its limit leaves it: stopped while its second model closes."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    gc = _module()
    from vp_accelerate.runtime import pipeline

    class Killed(BaseException):  # not an Exception: main() does not turn it into a result
        pass

    real_close, calls = pipeline.PipelineModel.close, []

    def close(self):
        real_close(self)
        calls.append(1)
        if len(calls) == 2:
            raise Killed

    pipeline.PipelineModel.close = close
    try:
        gc.main(["--part", "streams_1gpu", "--out", out, "--tiny"])
    except Killed:
        pass


def test_a_streams_part_killed_part_way_leaves_its_figures(tmp_path):
    """Killed after its second model (a time limit, a hang, a crash), the streams part has left a JSON with
    the races of the models it ran and why it is incomplete (it used to leave nothing), and the summary
    reads it."""
    spawn(_streams_killed_after_one_model, 1, str(tmp_path), timeout_s=300)
    result = json.loads((tmp_path / "streams_1gpu.json").read_text())
    assert result["status"] == "fail" and len(result["races"]) == 1, result
    assert result["why"].startswith("stopped part-way") and result["why"].endswith("after 1f1b/baseline float64")
    _, text = _module().summarize(tmp_path)
    assert "| streams_1gpu | fail | races: 1 steps" in text


def test_the_output_layer_part_fails_when_its_numbers_are_off():
    gc = _module()
    size = {"ranks": (1, 2, 4, 8), "algorithms": ("vocab-1", "vocab-2")}

    def rows(eff=1.0, peak8=1.2e9, drop=None):
        out = [{"p": None, "algorithm": "baseline", "time_s": 0.05, "peak_bytes": 9e9}]
        for algo in size["algorithms"]:
            for p in size["ranks"]:
                if (algo, p) != drop:
                    out.append(
                        {
                            "p": p,
                            "algorithm": algo,
                            "time_s": 0.05 / (p * eff),
                            "efficiency": eff,
                            "peak_bytes": peak8 if p == 8 else 8e9 / p,
                        }
                    )
        return out

    assert gc.judge_output_layer(rows(), size, tiny=False) == []
    assert gc.judge_output_layer(rows(eff=0.95), size, tiny=False) == []
    slow = gc.judge_output_layer(rows(eff=0.4), size, tiny=False)
    assert len(slow) == 8 and "vocab-1 p=1 efficiency 40% outside 60%-160%" in slow[0]
    assert gc.judge_output_layer(rows(eff=2.5), size, tiny=False)  # faster than the full layer per row: broken timing
    assert gc.judge_output_layer(rows(peak8=7e9), size, tiny=False) == [
        "vocab-1 peak memory at p=8 is 0.88 x that at p=1 (> 0.35)",
        "vocab-2 peak memory at p=8 is 0.88 x that at p=1 (> 0.35)",
    ]
    assert gc.judge_output_layer(rows(drop=("vocab-2", 4)), size, tiny=False) == ["vocab-2 p=4 not measured"]
    assert gc.judge_output_layer(rows(drop=("vocab-2", 4)), size, tiny=True) == ["vocab-2 p=4 not measured"]
    assert gc.judge_output_layer(rows(eff=0.4), size, tiny=True) == []  # tiny CPU timings are noise: not judged
    assert gc.judge_output_layer(rows()[1:], size, tiny=False) == ["the full-vocabulary reference was not measured"]


def test_a_sync_is_named_by_its_frames_in_hf_and_in_our_code(tmp_path):
    """The sync-debug part's attribution (it used to stop the step at the first sync, with no place named):
    the innermost frame in each package's folder, None where the stack never enters it; a sync warning
    raised under record_syncs is recorded with the stack that raised it, not printed, and other warnings
    still show; summarize_syncs reports the first sync and the first one in HF code."""
    import traceback

    gc = _module()
    hf, ours = tmp_path / "site-packages" / "transformers", tmp_path / "vp_accelerate"
    stack = traceback.StackSummary.from_list(
        [
            (str(ours / "runtime" / "pipeline.py"), 230, "train_step", ""),
            (str(ours / "models" / "chunk.py"), 88, "forward", ""),
            (str(hf / "models" / "llama" / "modeling_llama.py"), 400, "forward", ""),
            (str(hf / "masking_utils.py"), 120, "sdpa_mask", ""),
            (str(tmp_path / "torch" / "functional.py"), 9, "any", ""),
        ]
    )
    roots = {"transformers": hf, "vp_accelerate": ours}
    assert gc.sync_site(stack, roots) == {
        "transformers": "transformers/masking_utils.py:120 in sdpa_mask",
        "vp_accelerate": "vp_accelerate/models/chunk.py:88 in forward",
    }
    assert gc.sync_site(stack[:2], roots) == {
        "transformers": None,
        "vp_accelerate": "vp_accelerate/models/chunk.py:88 in forward",
    }

    def blocking_call():
        import warnings

        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)

    sites = []
    here = {"tests": Path(__file__).parent}
    with pytest.warns(UserWarning, match="something else"):
        with gc.record_syncs(sites, here):
            blocking_call()
            blocking_call()
    line = blocking_call.__code__.co_firstlineno + 3
    assert sites == [{"tests": f"tests/test_gpu_check.py:{line} in blocking_call"}] * 2
    found = [("1f1b/baseline plain", {"transformers": None, "vp_accelerate": "a.py:1 in f"})]
    found += [("vhalf/vocab-1 padded", gc.sync_site(stack, roots))] * 2
    figures = gc.summarize_syncs(found)
    assert figures["syncs"] == 3 and figures["first"]["run"] == "1f1b/baseline plain"
    assert figures["first_in_transformers"]["transformers"] == "transformers/masking_utils.py:120 in sdpa_mask"
    assert [s["count"] for s in figures["sites"]] == [1, 2]
    assert "first in HF at transformers/masking_utils.py:120" in gc._syncs_line({"checked_steps": 4, **figures})


def test_summary_names_what_did_not_run_and_quotes_table_3(tmp_path):
    gc = _module()
    (tmp_path / "vocab_ws1.json").write_text(
        json.dumps(
            {
                "part": "vocab_ws1",
                "status": "fail",
                "max_rel_error": 3e-3,
                "tolerance": 1e-4,
                "tiny": False,
                "device_name": "NVIDIA H200",
                "why": "over the tolerance 0.0001: vocab-2/chunked 3.0e-03",
            }
        )
    )
    results, text = gc.summarize(tmp_path)
    assert "Device: NVIDIA H200." in text and "Every part runs at world size 1" in text
    assert "| vocab_ws1 | fail | max relative error 3.0e-03 (tolerance 0.0001) |" in text
    assert "- vocab_ws1: over the tolerance 0.0001: vocab-2/chunked 3.0e-03" in text
    for part in PARTS[1:]:
        assert f"| {part} | not run |" in text and f"- {part}: no result" in text
    assert "NCCL exactness" not in text and "share" not in results
    for row in (
        "| 2048 | output vocab-1 | 91.3% | 84.2% | 80.6% |",
        "| 2048 | output vocab-2 | 86.7% | 79.8% | 75.9% |",
        "| 2048 | input | 40.0% | 28.9% | 15.2% |",
        "| 4096 | output vocab-1 | 93.2% | 88.0% | 85.2% |",
        "| 4096 | output vocab-2 | 88.4% | 83.4% | 79.7% |",
        "| 4096 | input | 27.7% | 15.5% | 8.4% |",
    ):
        assert row in text
    assert gc.main(["--summarize", "--out", str(tmp_path)]) == 1  # not every part passed


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").exists(), reason="no .venv in this checkout")
def test_the_script_prefers_the_repository_venv(tmp_path):
    run = subprocess.run(
        [shutil.which("bash"), str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path), "no_such_part"],
        capture_output=True,
        text=True,
        env=_env("/usr/bin:/bin"),
        timeout=60,
    )
    assert run.stdout.splitlines()[0] == f"gpu_check: {ROOT}/scripts/../.venv/bin/python"
    assert run.returncode == 2 and "unknown part 'no_such_part'" in run.stderr


@pytest.mark.slow
def test_the_quickstart_part_on_the_cpu(tmp_path):
    """The quickstart part's tiny path: demo corpus, tokenizer and a one-process `accelerate launch` on the CPU
    (3 steps); its metrics hold a finite loss per step."""
    assert spawn(_other_parts, 1, str(tmp_path), ["quickstart_bf16"], timeout_s=600)[0] == [0, 1]
    result = json.loads((tmp_path / "quickstart_bf16.json").read_text())
    assert result["status"] == "pass" and result["steps"] == 3 and result["device"] == "cpu", result
