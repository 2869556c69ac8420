"""The `fedsaddle` command's entry point: Ctrl-C at any moment exits 130 with one line.

fedsaddle.cli handles Ctrl-C while a command runs; this module covers the moments
around it, where a KeyboardInterrupt would otherwise print a traceback and end the
process by the signal: while the command line's modules load (half a second of
imports), and once the command has ended, while the interpreter shuts down (ignored).
"""

from __future__ import annotations

import signal
import sys

EXIT_INTERRUPTED = 130


def main() -> int:
    code = EXIT_INTERRUPTED
    try:
        from fedsaddle.cli import main as command_line

        code = command_line()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a second one must not cut this line short)
        print("fedsaddle: interrupted", file=sys.stderr)
    finally:
        # The command has ended and said how: a Ctrl-C while the interpreter shuts down (its handler is
        # gone by then, and the signal would kill the process) is not news.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(main())
