"""`vp-accelerate <command>`: one entry point that dispatches to each layer's own command.

Each command lives beside the code it drives; this file only maps names to them, importing lazily
so that `vp-accelerate simulate` does not pay for transformers and `--help` stays instant.
"""

from __future__ import annotations

import importlib
import sys

from vp_accelerate import exit_codes

# name -> (module, function, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("vp_accelerate.train.cli.commands", "train_main", "train from a recipe (run under accelerate launch)"),
    "export": ("vp_accelerate.train.cli.commands", "export_main", "turn a checkpoint into an HF model directory"),
    "launch": (
        "vp_accelerate.train.cli.launch",
        "launch_main",
        "accelerate launch ... train RECIPE, exiting 2 on a user error (one line, no launcher traceback)",
    ),
    "selftest": ("vp_accelerate.vocab.selftest", "main", "check the vocabulary-parallel math on N ranks"),
    "simulate": ("vp_accelerate.sim.commands", "simulate_main", "simulate a schedule: step time, MFU, memory"),
    "plot-schedule": ("vp_accelerate.sim.commands", "plot_schedule_main", "draw a schedule's timeline as PNG"),
    "plan": (
        "vp_accelerate.train.cli.plan",
        "plan_main",
        "the fastest layouts of a model on N GPUs (schedule, method, pp x dp, microbatches, memory)",
    ),
    "dryrun": (
        "vp_accelerate.train.cli.dryrun",
        "dryrun_main",
        "a layout's real runtime on this CPU with fake tensors: memory per rank, the world's NCCL replay",
    ),
    "bench": ("vp_accelerate.bench.run", "bench_main", "benchmark methods side by side on local ranks"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: vp-accelerate <command> [args...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run `vp-accelerate <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"vp-accelerate: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return exit_codes.USER_ERROR
    module, func, _ = COMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
