"""The server's counters as a prometheus-client collector.

``A2ACollector`` reads the plain counters the server keeps on its hot path
(``metrics.Metrics``, ``rpcmetrics.RpcMetrics``) only when it is scraped, so
counting costs an integer increment; register it in any
``prometheus_client`` registry (``A2AServer`` serves its own at
``/metrics``, with the process metrics; an embedder registers
``A2AService.collector()`` in theirs).

Names: the server's own metrics start with ``a2a_``; the per-RPC ones are
the gRPC ecosystem's ``grpc_server_*`` (see ``rpcmetrics``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ..log.tasklog import LogPool
from ..obs.metrics import Histogram, Metrics
from ..rpc.metrics import RpcMetrics

RPC_LABELS = ["grpc_service", "grpc_method", "grpc_type"]


class A2ACollector(Collector):
    """Yields every metric of one server (see the module docstring).

    Args:
        metrics: The server's counters.
        rpc: The per-RPC counters (None: no metrics interceptor).
        pool: The server's task logs, read for their gauges (``LogPool.statistics``).
        auth: The authenticator: one that reads its credentials again at run
            time (``TokenFile``) says how many it holds (``credentials``) and
            how many re-reads failed (``reload_failures``).
    """

    def __init__(
        self,
        metrics: Metrics,
        rpc: RpcMetrics | None = None,
        pool: LogPool | None = None,
        auth: object | None = None,
    ) -> None:
        self._metrics, self._rpc, self._pool, self._auth = metrics, rpc, pool, auth

    def collect(self) -> Iterator[Metric]:
        """The current values."""
        m = self._metrics
        yield _counter("a2a_tasks_started", "Tasks started.", m.tasks_started)
        yield _labelled("a2a_tasks_ended", "Tasks ended, by final state.", "state", m.tasks_ended)
        yield _counter("a2a_final_frames", "Final frames delivered to streams.", m.final_frames)
        yield _gauge("a2a_streams_open", "Streams being served.", m.streams_open)
        yield _labelled("a2a_streams_ended", "Streams ended, by reason.", "reason", m.streams_ended)
        yield _counter(
            "a2a_log_frames_dropped",
            "Frames task logs dropped for their byte or frame budget.",
            m.frames_dropped,
        )
        yield _counter(
            "a2a_dropped_events",
            "Executor events dropped (after the task ended).",
            m.dropped_events,
        )
        yield _gauge("a2a_relays_open", "Tasks of other instances relayed here.", m.relays_open)
        if self._pool is not None:
            logs = self._pool.statistics()
            yield _gauge(
                "a2a_log_bytes", "Bytes the task logs keep (frames plus 64 each).", logs.used
            )
            yield _gauge(
                "a2a_logs_retained", "Ended tasks whose log is kept for resuming.", logs.retained
            )
        yield _counter(
            "a2a_tasks_reaped",
            "Tasks of lost instances ended FAILED by this instance.",
            m.tasks_reaped,
        )
        yield _counter(
            "a2a_tasks_released",
            "Waiting tasks left to the cluster (this instance's at shutdown, lost ones' swept).",
            m.tasks_released,
        )
        yield _counter(
            "a2a_tasks_claimed",
            "Waiting tasks owned by nobody this instance took over.",
            m.tasks_claimed,
        )
        yield _labelled(
            "a2a_push_deliveries",
            "Frames POSTed to webhooks, by outcome (delivered, given_up).",
            "outcome",
            m.push_deliveries,
        )
        yield _counter("a2a_push_retries", "Webhook attempts retried.", m.push_retries)
        yield _gauge("a2a_push_in_flight", "Webhook requests in flight.", m.push_in_flight)
        yield _gauge(
            "a2a_push_deliveries_running",
            "Webhooks following a task's log.",
            m.push_deliveries_running,
        )
        yield _counter(
            "a2a_push_frames_skipped",
            "Times a webhook fell behind its task's log and got the task as it was instead.",
            m.push_frames_skipped,
        )
        yield _gauge(
            "a2a_push_failing_configs",
            "Webhooks whose last frame was given up.",
            len(m.push_failing),
        )
        yield _histogram("a2a_cancel_seconds", "CancelTask to final frame.", m.cancel_seconds)
        yield _histogram(
            "a2a_push_delivery_seconds",
            "First attempt to delivery of a frame to a webhook (retries included).",
            m.push_lag_seconds,
        )
        if self._rpc is not None:
            yield from self._rpc_metrics(self._rpc)
        failures = getattr(self._auth, "reload_failures", None)
        if isinstance(failures, int):
            yield _counter(
                "a2a_auth_reload_failures",
                "Re-reads of the credentials file that failed (each revoked every credential).",
                failures,
            )
            yield _gauge(
                "a2a_auth_credentials",
                "Credentials held now (0 while the file does not read well).",
                getattr(self._auth, "credentials", 0),
            )

    def _rpc_metrics(self, rpc: RpcMetrics) -> Iterator[Metric]:
        started = CounterMetricFamily(
            "grpc_server_started", "RPCs started on the server.", labels=RPC_LABELS
        )
        for labels, count in sorted(rpc.started.items()):
            started.add_metric(list(labels), count)
        yield started
        handled = CounterMetricFamily(
            "grpc_server_handled",
            "RPCs completed on the server, by status code.",
            labels=[*RPC_LABELS, "grpc_code"],
        )
        for code_labels, count in sorted(rpc.handled.items()):
            handled.add_metric(list(code_labels), count)
        yield handled
        seconds = HistogramMetricFamily(
            "grpc_server_handling_seconds",
            "Seconds from an RPC's start to its end (a stream's whole life).",
            labels=RPC_LABELS,
        )
        for labels, histogram in sorted(rpc.seconds.items()):
            if histogram.n:
                buckets, total = _buckets(histogram)
                seconds.add_metric(list(labels), buckets, total)
        yield seconds


def _counter(name: str, text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, text, value=value)


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=value)


def _labelled(name: str, text: str, label: str, counts: Mapping[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, text, labels=[label])
    for value, count in sorted(counts.items()):
        family.add_metric([value], count)
    return family


def _histogram(name: str, text: str, histogram: Histogram) -> HistogramMetricFamily:
    buckets, total = _buckets(histogram)
    return HistogramMetricFamily(name, text, buckets=buckets, sum_value=total)


def _buckets(histogram: Histogram) -> tuple[list[tuple[str, float]], float]:
    cumulative = 0
    buckets: list[tuple[str, float]] = []
    for bound, count in zip((*histogram.bounds, float("inf")), histogram.counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
    return buckets, histogram.total
