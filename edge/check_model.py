"""`edge check-model PATH.gguf`: what an operator runs before trusting a new model.

Reads the GGUF without starting the service and says whether the handoff can carry its KV. Exit status 0 when
every check passes, 1 when one fails, with the reason on one line: never a traceback.
"""

from __future__ import annotations

import argparse

from contracts.identity import UnsupportedModelError, check_supported


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", metavar="PATH.gguf", help="the model file to check")


def run(args: argparse.Namespace) -> int:
    try:
        check_supported(args.gguf)
    except (UnsupportedModelError, FileNotFoundError) as err:
        print(f"FAIL: {err}")
        return 1
    print(f"PASS: {args.gguf} is supported")
    return 0
