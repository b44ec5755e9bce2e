"""The ``cuteinfer`` command. Each subcommand lives in its own module and is imported lazily.

Errors are one line on stderr, ``cuteinfer: error: <message>``, never a traceback unless
``--debug`` is given (before or after the subcommand). Exit status: 2 when the input is at fault
(an option, the checkpoint, a request, a missing extra: the message says what to change), 1 for
anything unexpected, 130 on Ctrl-C.

Diagnostics (downloads, conversion, graph capture, the load report) go through ``logging``
module loggers; ``main`` configures them (a subcommand may again, with its own level): the
package's loggers at INFO (DEBUG with ``--debug``), everything else at WARNING, one
``[cuteinfer] ...`` line each on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from typing import NoReturn, TextIO

from engine import __version__

# subcommand -> (module, help). Each module defines add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("engine.commands.generate", "generate text with a model (default: SmolLM2-135M)"),
    "check-kv": ("engine.commands.check_kv",
                 "property-based run of the block manager (Hypothesis)"),
    "serve": ("engine.server.cli", "OpenAI-compatible HTTP server"),
    "profile-graphs": ("engine.commands.profile_graphs",
                       "capture and profile the decode CUDA graphs"),
    "warmup": ("engine.commands.warmup",
               "compile a model's kernels into the kernel cache (no GPU needed)"),
}
# Modules of the optional extras (pyproject.toml) -> (pip package, extra that installs it).
EXTRAS: dict[str, tuple[str, str]] = {
    "fastapi": ("fastapi", "server"), "uvicorn": ("uvicorn", "server"),
    "starlette": ("fastapi", "server"), "prometheus_client": ("prometheus-client", "server"),
    "matplotlib": ("matplotlib", "profile"), "hypothesis": ("hypothesis", "test"),
}
# Errors that mean the input is at fault, by (module, class). Their messages name the field or
# file and say what to change. A class whose module was never imported cannot have been raised,
# so the handler looks them up in sys.modules instead of importing the engine to catch them.
INPUT_ERRORS = (
    ("engine.config", "ConfigError"), ("engine.model.loader", "CheckpointError"),
    ("engine.model.safetensors_io", "SafetensorsError"), ("engine.engine", "RequestError"),
    ("engine.sampling_params", "SamplingParamsError"), ("engine.tokenizer", "TokenizerError"),
    ("engine.model.gguf_convert", "GGUFConvertError"), ("engine.cuda.driver", "NoGpuError"),
)
# Expected failures of the environment (no network for the default model): exit 1, no hint.
ENVIRONMENT_ERRORS = (("engine.model.fetch", "FetchError"),)
# The package's loggers (modules log under their __name__; the server under "cuteinfer.server").
PACKAGE_LOGGERS = ("engine", "graphs", "cutlass_kernels", "cuteinfer")
HANDLER = "cuteinfer-stderr"  # the name of the root handler configure_logging adds


class CLIError(Exception):
    """A usage error: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse prints usage + error; we print one line
        raise CLIError(f"{message} (see '{self.prog} --help')")


def _classes(names: tuple[tuple[str, str], ...]) -> tuple[type[BaseException], ...]:
    return tuple(getattr(sys.modules[m], c) for m, c in names if m in sys.modules)


def _report(e: Exception, command: str | None) -> tuple[int, str]:
    """(exit status, message) for an exception that ended a command."""
    if isinstance(e, CLIError):
        return 2, str(e)
    if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in EXTRAS:
        package, extra = EXTRAS[(e.name or "").split(".")[0]]
        return 2, (f"'{command}' needs the Python package '{package}', which is not installed: "
                   f"pip install 'cuteinfer[{extra}]'")
    if isinstance(e, _classes(INPUT_ERRORS)):
        hint = ""
        if type(e).__name__ == "NoGpuError" and command in ("generate", "serve"):
            hint = "; --backend numpy runs on the CPU"
        return 2, f"{e}{hint}"
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return 2, f"{e.filename}: {e.strerror}"  # a path given on the command line
    if isinstance(e, _classes(ENVIRONMENT_ERRORS)):
        return 1, str(e)
    return 1, f"{type(e).__name__}: {e} (run with --debug for the traceback)"


def _debug_requested(argv: list[str]) -> bool:
    return "--debug" in argv[: argv.index("--") if "--" in argv else len(argv)]


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (as logging's lastResort
    does), so that a redirected or captured stderr gets the lines."""

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


class _Formatter(logging.Formatter):
    """``[cuteinfer] message`` at INFO; the level and the logger's name otherwise."""

    def format(self, record: logging.LogRecord) -> str:
        head = ("[cuteinfer]" if record.levelno == logging.INFO
                else f"[cuteinfer] {record.levelname} {record.name}:")
        return f"{head} {super().format(record)}"


def configure_logging(debug: bool = False, level: int | str = logging.INFO) -> None:
    """One stderr handler on the root logger, however often this runs: the handler named
    ``HANDLER`` that an earlier call added is replaced. (Not "is there a ``_Stderr`` already?":
    under ``python -m engine.cli`` this file runs twice, as ``__main__`` and as ``engine.cli``
    imported by a subcommand, so there are two ``_Stderr`` classes.) The package's loggers at
    ``level`` (a name such as "warning" or a number), DEBUG with ``debug``; other libraries' at
    WARNING."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if h.get_name() == HANDLER]
    for h in ours:
        root.removeHandler(h)
    handler = _Stderr()
    handler.set_name(HANDLER)
    handler.setFormatter(_Formatter())
    root.addHandler(handler)
    if not ours:
        root.setLevel(logging.WARNING)
    for name in PACKAGE_LOGGERS:
        logging.getLogger(name).setLevel(
            logging.DEBUG if debug else level.upper() if isinstance(level, str) else level)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = _debug_requested(argv)
    configure_logging(debug)
    # The command is the first word that is not an option: the top level takes no values.
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        return _run(argv, command)
    except KeyboardInterrupt:
        print("\ncuteinfer: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        code, message = _report(e, command)
        if debug:
            traceback.print_exc()
            message = message.removesuffix(" (run with --debug for the traceback)")
        print(f"cuteinfer: error: {message}", file=sys.stderr)
        return code


def _run(argv: list[str], command: str | None) -> int:
    parser = _Parser(prog="cuteinfer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    parser.add_argument("-v", "--version", action="version", version=__version__,
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        # Also accepted after the subcommand; SUPPRESS keeps a top-level --debug from being reset.
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
        if name == command:  # import only the module of the command that runs
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    args = parser.parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
