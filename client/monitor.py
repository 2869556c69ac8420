"""A client process's monitor (`fedsaddle client --monitor HOST:PORT`): Prometheus metrics at /metrics.

`ClientStats` is what the session counts as it goes (tasks answered, the time from a task's
last instruction to its answer made, bytes each way, sessions opened); `serve_metrics` serves
them with prometheus-client through the read-only endpoint of common/monitoring.py (loopback
unless given TLS and a scraper token). It shows counts and times, never the data or a vector.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fedsaddle.common.monitoring import Exposure, MonitorError, MonitorServer, Reply

__all__ = ["ClientStats", "serve_metrics"]


@dataclass
class ClientStats:
    """One client process's counts (written by its event loop's thread, read by the monitor's)."""

    clients: tuple[int, ...] = ()
    tasks: int = 0
    compute_s: float = 0.0
    bytes_received: int = 0
    bytes_sent: int = 0
    sessions: int = 0

    def answered(self, seconds: float) -> None:
        self.tasks += 1
        self.compute_s += seconds

    def received(self, size: int) -> None:
        self.bytes_received += size

    def sent(self, message: Any) -> None:
        self.bytes_sent += len(message) if isinstance(message, bytes | bytearray | memoryview) else message.ByteSize()

    def counting(self, parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
        """A stream's deserializer that counts the bytes it reads."""

        def counted(data: bytes) -> Any:
            self.bytes_received += len(data)
            return parse(data)

        return counted


def serve_metrics(exposure: Exposure, stats: ClientStats) -> MonitorServer:
    """Serve `stats` at /metrics; MonitorError (naming the problem) if it cannot."""
    try:
        import prometheus_client
    except ImportError:
        raise MonitorError("--monitor: needs prometheus-client: pip install 'fedsaddle[monitor]'") from None
    registry = prometheus_client.CollectorRegistry()
    registry.register(_Collector(stats))

    def metrics() -> Reply:
        return Reply(prometheus_client.generate_latest(registry), prometheus_client.CONTENT_TYPE_LATEST)

    return MonitorServer(exposure, {"/metrics": metrics}, what="--monitor")


class _Collector:
    def __init__(self, stats: ClientStats) -> None:
        self.stats = stats

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.stats
        yield GaugeMetricFamily("fedsaddle_client_hosted", "Client indices this process hosts", value=len(s.clients))
        yield CounterMetricFamily("fedsaddle_client_tasks_answered", "Tasks answered", value=s.tasks)
        yield CounterMetricFamily(
            "fedsaddle_client_compute_seconds",
            "Time from a task's last instruction in to its answer made (decoding and local computation)",
            value=s.compute_s,
        )
        traffic = CounterMetricFamily(
            "fedsaddle_client_bytes", "Bytes of the session streams, by direction", labels=["direction"]
        )
        traffic.add_metric(["received"], s.bytes_received)
        traffic.add_metric(["sent"], s.bytes_sent)
        yield traffic
        yield CounterMetricFamily("fedsaddle_client_sessions", "Sessions opened with the coordinator", value=s.sessions)
