"""The `fedsaddle` command's entry point: Ctrl-C at any moment exits 130 with one line.

fedsaddle.cli handles Ctrl-C while a command runs; this module covers the moments
around it, where a KeyboardInterrupt would otherwise print a traceback and end the
process by the signal: while the command line's modules load (half a second of
imports), and once the command has ended, while the interpreter shuts down.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

EXIT_INTERRUPTED = 130


def _interrupted_at_exit(signum: int, frame: FrameType | None) -> None:
    sys.stderr.write("fedsaddle: interrupted\n")
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)  # the command is over: nothing is left to clean up but the interpreter


def main() -> int:
    try:
        from fedsaddle.cli import main as command_line

        code = command_line()
    except KeyboardInterrupt:
        print("fedsaddle: interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_at_exit)
    return code


if __name__ == "__main__":
    sys.exit(main())
