"""The ``cuteinfer`` command. Each subcommand lives in its own module and is imported lazily."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, help). Each module defines add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("engine.commands.generate", "generate text with a model (default: SmolLM2-135M)"),
    "check-kv": ("engine.kv.check", "property-based run of the block manager (Hypothesis)"),
    "serve": ("engine.server.cli", "OpenAI-compatible HTTP server"),
    "profile-graphs": ("graphs.profile", "capture and profile the decode CUDA graphs"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cuteinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    argv = sys.argv[1:] if argv is None else argv
    wanted = argv[0] if argv else None
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:  # import only the module of the command that runs
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as e:
                parser.error(f"'{name}' is unavailable: {e}")
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    args = parser.parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
