"""What a run reports: wandb through accelerate's tracker (rank 0), a local metrics.jsonl, rank stats.

Every rank calls the gathering helpers (they are collectives); only the main process writes.
"""

from __future__ import annotations

import json
import logging
import os
import resource

import torch
import torch.distributed as dist

from vp_accelerate.runtime.groups import host_group

log = logging.getLogger("vp_accelerate.train")


def gather(obj) -> list:
    """all_gather_object over the world (a 1-element list without a process group), on the gloo side
    group: on GPUs the default group is NCCL, which would stage the pickled bytes through GPU memory."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=host_group())
    return out


_CUDA_RUN_PEAK = 0  # the allocator's peak over the run (its own counter is reset at every log)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process over the run: CUDA allocator peak on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return max(_CUDA_RUN_PEAK, int(torch.cuda.max_memory_allocated(device)))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def cuda_window_memory(device: torch.device) -> dict:
    """CUDA max allocated and max reserved bytes since the previous call (then the allocator's peaks are
    reset, so each logging step shows its own window); {} off CUDA."""
    global _CUDA_RUN_PEAK
    if device.type != "cuda":
        return {}
    out = {
        "cuda_max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "cuda_max_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
    }
    _CUDA_RUN_PEAK = max(_CUDA_RUN_PEAK, out["cuda_max_allocated_bytes"])
    torch.cuda.reset_peak_memory_stats(device)
    return out


def resident_bytes() -> int:
    """Current resident set size of this process (VmRSS), 0 where /proc is unavailable.

    The peak (ru_maxrss) only ever grows, so it cannot show a slow leak's slope; the current RSS can.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return 0


def rank_stats(pipe, device: torch.device, step_time_s: float | None = None) -> dict:
    """This rank's memory numbers (and its mean step time since the last log), to gather."""
    stats = pipe.stats()
    out = {
        "peak_activation_bytes": int(stats.get("peak_activation_bytes", 0)),
        "param_bytes": int(stats.get("param_bytes", 0)),
        "peak_memory_bytes": peak_memory_bytes(device),
        "rss_bytes": resident_bytes(),
    }
    out.update(cuda_window_memory(device))  # after the run peak above has read the allocator's counter
    if step_time_s is not None:
        out["step_time_s"] = float(step_time_s)
    return out


def rank_metrics(all_stats: list[dict]) -> dict:
    """Flatten gathered per-rank stats into wandb metric names (MiB)."""
    out = {}
    for r, s in enumerate(all_stats):
        out[f"memory/rank{r}_peak_activation_mib"] = s["peak_activation_bytes"] / 2**20
        out[f"memory/rank{r}_param_mib"] = s["param_bytes"] / 2**20
        out[f"memory/rank{r}_peak_mib"] = s["peak_memory_bytes"] / 2**20
        if "rss_bytes" in s:
            out[f"memory/rank{r}_rss_mib"] = s["rss_bytes"] / 2**20
        if "cuda_max_allocated_bytes" in s:  # since the previous log
            out[f"memory/rank{r}_cuda_max_allocated_mib"] = s["cuda_max_allocated_bytes"] / 2**20
            out[f"memory/rank{r}_cuda_max_reserved_mib"] = s["cuda_max_reserved_bytes"] / 2**20
        if "step_time_s" in s:
            out[f"perf/rank{r}_step_time_s"] = s["step_time_s"]
    return out


def start_metrics(path: str, resumed_step: int | None) -> str | None:
    """Prepare `path` (metrics.jsonl) for a run; returns where an earlier run's file was moved, if it was.

    A new run never appends to an earlier one: that file becomes metrics.1.jsonl (metrics.2.jsonl, ...: the
    first free name). A resumed run appends, after dropping rows logged past the checkpoint it resumes from
    (the interrupted run's steps that are trained again), so the file reads as one run.
    """
    if not os.path.isfile(path):
        return None
    if resumed_step is None:
        stem, ext = os.path.splitext(path)
        k = 1
        while os.path.exists(f"{stem}.{k}{ext}"):
            k += 1
        os.replace(path, f"{stem}.{k}{ext}")
        return f"{stem}.{k}{ext}"
    with open(path) as f:
        rows = [line for line in f if line.strip()]
    kept = [line for line in rows if json.loads(line).get("step", 0) <= resumed_step]
    if len(kept) != len(rows):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)
    return None


class Tracker:
    """wandb (through accelerate) + a local JSON-lines log, written on the main process only."""

    def __init__(self, accelerator, recipe, recipe_dict: dict, resumed_step: int | None = None):
        """`resumed_step`: the step a resumed run continues after (None: a new run). One metrics.jsonl per run:
        a new run moves an earlier run's file aside; a resumed one keeps its rows up to `resumed_step`."""
        self.accelerator = accelerator
        self.enabled = recipe.logging.wandb_mode != "disabled"
        self.is_main = accelerator.is_main_process
        out = recipe.logging.output_dir
        self.metrics_path = os.path.join(out, "metrics.jsonl")
        if self.is_main:
            os.makedirs(out, exist_ok=True)
            start_metrics(self.metrics_path, resumed_step)
        if self.enabled:
            init = {"mode": recipe.logging.wandb_mode, "dir": out}
            if recipe.logging.run_name:
                init["name"] = recipe.logging.run_name
            accelerator.init_trackers(recipe.logging.wandb_project, config=recipe_dict, init_kwargs={"wandb": init})

    def log(self, metrics: dict, step: int) -> None:
        if not self.is_main:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.enabled:
            self.accelerator.log(metrics, step=step)

    def log_samples(self, rows: list[dict], step: int, key: str = "eval/samples") -> None:
        """Generated samples ({"prompt", "completion"} each): a wandb table `key` and one metrics.jsonl row."""
        if not self.is_main:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"step": step, key: rows}, ensure_ascii=False) + "\n")
        if self.enabled:
            self.accelerator.get_tracker("wandb").log_table(
                key,
                columns=["step", "prompt", "completion"],
                data=[[step, r["prompt"], r["completion"]] for r in rows],
                step=step,
            )

    def log_image(self, key: str, path: str, step: int) -> None:
        if self.is_main and self.enabled:
            self.accelerator.get_tracker("wandb").log_images({key: [path]}, step=step)

    def finish(self) -> None:
        if self.enabled:
            self.accelerator.end_training()


def plot_measured_timeline(timelines: list, path: str, title: str | None = None) -> str | None:
    """Draw the gathered per-rank timelines with the simulator's plotter; None if it is unavailable."""
    try:  # matplotlib: only rank 0 draws, once, at the end of a run
        from vp_accelerate.sim.plot import plot_timeline
    except ImportError:
        log.info("vp_accelerate.sim.plot is not available; skipping the timeline image")
        return None
    try:
        plot_timeline(timelines, path, title=title)
    except Exception as e:  # noqa: BLE001 - an image is not worth failing a training run for
        log.warning("could not draw the timeline: %s: %s", type(e).__name__, e)
        return None
    return path
