"""`tpkit <command>`: each command lives in its own module, imported only when used
(so `tpkit plan` and `tpkit quiz` start without importing torch).

A command module defines `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "verify": ("tpkit.commands.verify", "check sharded layers/models against tp=1 (outputs, grads, ledger)"),
    "train": ("tpkit.commands.train", "train a model with tensor x pipeline x data parallelism"),
    "plan": ("tpkit.commands.plan", "plan tp/pp/dp for a model on a cluster (no torch needed)"),
    "calibrate": ("tpkit.commands.calibrate", "measure this machine into a hardware profile"),
    "convert": ("tpkit.commands.convert", "convert / reshard checkpoints, to and from safetensors"),
    "prepare-data": ("tpkit.commands.prepare_data", "tokenize text files into token shards "
                     "for training"),
    "generate": ("tpkit.commands.generate", "tensor-parallel text generation with a KV cache"),
    "quiz": ("tpkit.commands.quiz", "the tensor-parallelism quiz, as a live tutor (fr/en)"),
    "presets": ("tpkit.commands.presets", "list the model presets and the Hugging Face families"),
}


def _usage() -> str:
    lines = ["usage: tpkit <command> [options]", "", "commands:"]
    width = max(map(len, COMMANDS))
    lines += [f"  {name:<{width}} {desc}" for name, (_, desc) in COMMANDS.items()]
    lines.append("\n`tpkit <command> --help` for the options of one command.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `tpkit` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name = argv[0]
    if name not in COMMANDS:
        print(f"tpkit: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, desc = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(f"tpkit: command {name!r} is not available in this build", file=sys.stderr)
            return 2
        raise
    parser = argparse.ArgumentParser(prog=f"tpkit {name}", description=desc)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
