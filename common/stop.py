"""What a SIGTERM handler raises to stop a process cleanly, the coordinator's and a client's alike."""

from __future__ import annotations


class Stopped(BaseException):
    """SIGTERM: stop cleanly (the coordinator writes its outputs and says goodbye; a client closes its
    session).

    A BaseException, as KeyboardInterrupt is: the handler raises it wherever the main thread
    computes, inside a problem's gradient too, and no `except Exception` there may take it for an error.
    """
