"""`tokenplane` command line. Each subcommand lives next to the mechanism it drives and is imported lazily."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, function, help). The function takes the argparse namespace; `add_arguments(parser)` in the same
# module (named `<function>_arguments`) declares its flags.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("tokenplane.serve.demo", "main", "the one server end to end: a real agent conversation through the "
             "OpenAI endpoint with the real model (exact IDs, session reuse, TTFT), plus routed decoding"),
    "demo-tokenize": ("tokenplane.demo", "main", "replay a real agent session through a tokenizer session alone "
                      "(exactness and repair latency against full encodes)"),
    "verify": ("tokenplane.tokenize.evidence.campaign", "main",
               "long differential campaign against the reference engine"),
    "warmup": ("tokenplane.tokenize.warmup", "main", "build the on-disk caches (tables, numba kernels) a fresh "
               "process's first encode reads, so it only loads them"),
    "serve": ("tokenplane.serve.cli", "main", "combined server: tokenize service + routed decoding (OpenAI API)"),
    "vllm-plugin-path": ("tokenplane.serve.upstream_sessions", "plugin_path", "print the directory to put on a vLLM "
                         "server's PYTHONPATH for `--middleware tokenplane_vllm_sessions.session_turns` (the session "
                         "route `serve --upstream-sessions` talks to)"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenplane", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, func_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.startswith("tokenplane"):
                p.set_defaults(_unavailable=f"{name}: not built yet ({exc.name})")
                continue
            raise
        add_args = getattr(module, f"{func_name}_arguments", None)
        if add_args is not None:
            add_args(p)
        p.set_defaults(_run=getattr(module, func_name))
    args = parser.parse_args(argv)
    if getattr(args, "_unavailable", None):
        print(args._unavailable, file=sys.stderr)
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
