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
import torch

from vp_accelerate.distributed import spawn
from vp_accelerate.schedule.registry import supported_pairs

ROOT = Path(__file__).resolve().parents[1]
PARTS = (
    "vocab_ws1",
    "schedules_ws1",
    "bf16_ws1",
    "zero_fused_1gpu",
    "progress_device_1gpu",
    "persist_1gpu",
    "memory_1gpu",
    "output_layer_1gpu",
    "streams_1gpu",
    "quickstart_bf16",
)
SLOW = ("persist_1gpu", "memory_1gpu", "quickstart_bf16")  # each starts interpreters of its own: slow tests
QUICK = tuple(p for p in PARTS if p not in SLOW)


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
    tools = [shutil.which(t) for t in ("timeout", "tail", "mkdir", "rm", "dirname", "tee")]
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
    assert statuses == [0] * (len(QUICK) - 1) + [1], (out / "summary.md").read_text()  # the slow ones: not run
    results = json.loads((out / "results.json").read_text())
    ran = {p: r for p, r in results.items() if p in QUICK}
    assert set(results) == set(PARTS) and all(r["status"] == "pass" and r["tiny"] for r in ran.values()), results
    assert all(results[p]["status"] == "not run" for p in SLOW)
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
    assert "| zero_fused_1gpu | pass | 4 fused AdamW steps on gloo, bit-identical True; step tensors cpu" in summary
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


def _python3_on(tmp_path) -> Path:
    """A folder holding `python3` (this interpreter) and the coreutils the script calls, and no `python`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    for tool in ("timeout", "tail", "mkdir", "rm", "dirname", "tee", "ls", "mktemp"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    return bin_dir


@pytest.mark.slow  # ~15 s: the whole script on python3; its parts' wiring stays in the suite
def test_the_script_takes_python3_names_its_versions_and_keeps_its_budget(tmp_path):
    """No $PYTHON: `python3` on the PATH, never the repository's .venv (the lent machine's image holds torch); its
    first lines name the interpreter and the versions found; with the whole check's budget spent
    (GPU_CHECK_TOTAL_S=0) no part starts, each says so, and the summary lists every part as not run."""
    bin_dir = _python3_on(tmp_path)
    out = tmp_path / "out"
    run = subprocess.run(
        [shutil.which("bash"), str(ROOT / "scripts" / "gpu_check.sh"), str(out), "--cpu"],
        capture_output=True,
        text=True,
        env={**_env(str(bin_dir)), "GPU_CHECK_TOTAL_S": "0"},
        timeout=300,
    )
    lines = run.stdout.splitlines()
    assert lines[0] == f"gpu_check: {bin_dir}/python3", run.stdout + run.stderr
    assert lines[1].startswith("gpu_check: Python 3.") and ", transformers 5." in lines[1] and "torch 2." in lines[1]
    assert ", datasets " in lines[1] and ", wandb " in lines[1]
    assert lines[2].startswith("gpu_check: torch 2.") and "no GPU visible" in lines[2]
    assert run.returncode == 1, run.stdout + run.stderr
    for part in PARTS:
        assert f"{part}: not started: the check's budget (GPU_CHECK_TOTAL_S) is spent" in run.stdout
        assert f"| {part} | not run |" in (out / "summary.md").read_text()


def test_the_script_refuses_unknown_parts_and_warns_of_missing_wheels(tmp_path):
    """An unknown part: exit 2 before any work. An interpreter without `datasets` and no wheels/ to install it
    from: a warning naming scripts/gpu_wheels.sh, and the check goes on (a python3 whose `import datasets` fails
    stands in for the image)."""
    bin_dir = _python3_on(tmp_path)
    run = subprocess.run(
        [shutil.which("bash"), str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path), "no_such_part"],
        capture_output=True,
        text=True,
        env=_env(str(bin_dir)),
        timeout=60,
    )
    assert run.returncode == 2 and "unknown part 'no_such_part'" in run.stderr
    blocker = tmp_path / "no_datasets"
    blocker.mkdir()
    (blocker / "datasets.py").write_text("raise ImportError('not in this image')\n")
    # the script puts the checkout first on PYTHONPATH, then this: the blocker shadows the installed datasets
    env = {**_env(str(bin_dir)), "PYTHONPATH": str(blocker), "GPU_CHECK_WHEELS": str(tmp_path / "none")}
    env["GPU_CHECK_TOTAL_S"] = "0"  # no part: the start alone
    run = subprocess.run(
        [shutil.which("bash"), str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "out"), "--cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 1, run.stdout + run.stderr  # the summary's: no part ran
    assert "gpu_check: WARNING: missing datasets and no wheels in" in run.stderr
    assert (
        "(run 'bash scripts/gpu_wheels.sh' where PyPI is reachable); the parts that need them will fail" in run.stderr
    )
    assert "zero_fused_1gpu: not started" in run.stdout
    assert ", datasets 5." in run.stdout  # installed here, but it does not import: the check says what it found


@pytest.mark.slow
def test_the_quickstart_part_on_the_cpu(tmp_path):
    """The quickstart part's tiny path: demo corpus, tokenizer and a one-process `accelerate launch` on the CPU
    (3 steps); its metrics hold a finite loss per step."""
    assert spawn(_other_parts, 1, str(tmp_path), ["quickstart_bf16"], timeout_s=600)[0] == [0, 1]
    result = json.loads((tmp_path / "quickstart_bf16.json").read_text())
    assert result["status"] == "pass" and result["steps"] == 3 and result["device"] == "cpu", result


def test_the_progress_part_tells_a_busy_device_from_a_host_hang(tmp_path, monkeypatch):
    """The device-hang part's CPU analogue (marks completed by a timer) passes on Progress as it is, and fails,
    naming what Progress said, when Progress does not track the device's marks (as if it ignored them)."""
    gc = _module()
    result = gc.part_progress_device_1gpu(True, tmp_path)
    assert result["status"] == "pass", result
    assert result["busy_report"].startswith("between steps") and "still on F(mb=0, chunk=0)" in result["busy_report"]
    assert result["host_hang_report"].startswith("in F(mb=1, chunk=0), computing")
    assert result["stalled_while_busy_s"] >= 0.8 * gc.PROGRESS_HOLD_S / 4 and result["long_kernel_s"] == 2.0
    from vp_accelerate.runtime import watchdog

    real = watchdog.Progress.finished
    monkeypatch.setattr(watchdog.Progress, "finished", lambda self, mark=None: real(self, None))
    blind = gc.part_progress_device_1gpu(True, tmp_path)
    assert blind["status"] == "fail" and "while the device ran the long pass Progress said" in blind["why"], blind


def _zero_part(out: str, broken: bool) -> dict:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    gc = _module()
    if broken:  # a resume that leaves `step` as a float64 scalar: what fused kernels refuse on a GPU
        from vp_accelerate.runtime.zero import ZeroOptimizer

        real = ZeroOptimizer.load_state_dict

        def load(self, state_dict):
            real(self, state_dict)
            for s in self.inner.state.values():
                s["step"] = s["step"].to(torch.float64)

        ZeroOptimizer.load_state_dict = load
    return gc.part_zero_fused_1gpu(True, Path(out))


def test_the_zero_part_checks_where_the_fused_step_lives(tmp_path):
    """ZeRO-1 with fused AdamW on a one-rank group (gloo here): bit-identical to plain fused AdamW through a
    resume, every `step` tensor float32 on the parameters' device; a resume that leaves `step` float64 fails."""
    result = spawn(_zero_part, 1, str(tmp_path), False, timeout_s=300)[0]
    assert result["status"] == "pass" and result["bit_identical"], result
    assert result["step_tensors"] == result["step_tensors_after_resume"] == ["cpu torch.float32"]
    assert result["backend"] == "gloo" and result["saved_state_on"] == ["cpu"]
    broken = spawn(_zero_part, 1, str(tmp_path), True, timeout_s=300)[0]
    assert broken["status"] == "fail" and "after load_state_dict the step tensors are on" in broken["why"], broken


def test_the_memory_part_judges_the_dry_run_against_the_allocator():
    """memory_1gpu's judgement from a probe's CUDA figures: the dry run within 0.9-1.1 x max_memory_allocated
    passes, outside fails naming the setting; a CPU probe's figures are a reported skip; the summary line."""
    gc = _module()
    gib = 2**30

    def probe(conf, allocated, cuda=True):
        last = {"phase": "second step"}
        if cuda:
            last.update(
                max_allocated=allocated,
                max_reserved=int(allocated * 1.1),
                reserved=int(allocated * 1.05),
                device_used=int(allocated * 1.1) + gib // 2,
                device_total=141 * 10**9,
            )
        return {"alloc_conf": conf, "cuda": cuda, "phases": [last], "seconds": 9.0}

    dry = {"peak_bytes": 40 * gib}
    rows, problems = gc.judge_memory(dry, {"default": probe(None, 39 * gib), "expandable": probe("e", 41 * gib)})
    assert problems == [] and [r["allocator"] for r in rows] == ["default", "expandable"]
    assert rows[0]["dryrun_over_allocated"] == pytest.approx(40 / 39)
    assert rows[0]["outside_allocator"] == int(39 * gib * 1.1) + gib // 2 - int(39 * gib * 1.05)
    _, problems = gc.judge_memory(dry, {"default": probe(None, 30 * gib)})
    assert len(problems) == 1 and problems[0].startswith("default: the dry run's peak 42.95 GB is 1.333 x")
    rows, problems = gc.judge_memory(dry, {"default": probe(None, 0, cuda=False)})
    assert problems == [] and rows[0]["measured"].startswith("skipped: no CUDA")
    line = gc._one_line(
        "memory_1gpu",
        {"status": "pass", "dryrun": dry, "rows": gc.judge_memory(dry, {"default": probe(None, 39 * gib)})[0]},
    )
    assert line.startswith("dry run peak 40.00 GiB; default: allocated 39.00 GiB (dry run x 1.026)")


@pytest.mark.slow  # ~30 s: a BPE, a training run and a resumed one in its own interpreter
def test_the_persist_part_on_the_cpu(tmp_path):
    """The trainer with background checkpoints, then --resume in a new process: the resumed steps equal the
    uninterrupted run's bit for bit on the CPU, each save written by a checkpoint-writer thread."""
    statuses = spawn(_other_parts, 1, str(tmp_path), ["persist_1gpu"], timeout_s=600)[0]
    result = json.loads((tmp_path / "persist_1gpu.json").read_text())
    assert statuses[0] == 0 and result["status"] == "pass", result
    assert result["bitwise"] and [r["step"] for r in result["rows"]] == [4, 5, 6]
    assert result["writer_threads"] == ["checkpoint-writer-0"] and len(result["snapshots"]) == 2


@pytest.mark.slow  # ~45 s: the dry run and two probes, each its own interpreter
def test_the_memory_part_on_the_cpu(tmp_path):
    """The dry run of the tiny layout and both allocator settings' probes run (the CUDA figures skipped)."""
    statuses = spawn(_other_parts, 1, str(tmp_path), ["memory_1gpu"], timeout_s=600)[0]
    result = json.loads((tmp_path / "memory_1gpu.json").read_text())
    assert statuses[0] == 0 and result["status"] == "pass", result
    assert [r["alloc_conf"] for r in result["rows"]] == [None, "expandable_segments:True"]
    assert result["dryrun"]["peak_bytes"] > 0 and not result["measured"]
