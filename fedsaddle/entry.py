"""The `fedsaddle` command's entry point: Ctrl-C at any moment exits 130 with one line.

fedsaddle.cli handles Ctrl-C while a command runs; this module covers the moments
around it, where a KeyboardInterrupt would otherwise print a traceback and end the
process by the signal: while the command line's modules load (half a second of
imports), and once the command has ended, while the interpreter shuts down (ignored).

An interrupted command leaves by os._exit(130), its outputs flushed: CPython marks a
KeyboardInterrupt raised inside source run by exec() (dataclasses and namedtuple build
their methods so, while modules load) as unhandled, whatever caught it since, and then
ends the process by SIGINT at exit instead of with the code sys.exit gave it.
"""

from __future__ import annotations

import logging
import os
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
    if code == EXIT_INTERRUPTED:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
