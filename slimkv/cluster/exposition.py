"""The ingress's ``/metrics``: every replica's ``slimkv:`` families merged into one
exposition, each sample labelled with its ``replica``.

Merged at the ingress rather than one port per replica: Serve places and restarts replicas
on any node with new ids, so a static ``deploy/prometheus.yml`` could not list them, and
one scrape target keeps the single-engine set-up (and its alerts and dashboard) unchanged
apart from the new label. A replica that does not answer in time is left out of that
scrape (and counted in ``slimkv:cluster_replicas_unreachable``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

REPLICA_LABEL = "replica"


class _Merged:
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge_expositions(texts: Mapping[str, bytes | str], extra: bytes = b"") -> bytes:
    """One exposition from ``{replica: exposition text}`` (plus the ingress's own, unlabelled
    ``extra`` families); families keep their type and help, samples gain ``replica``."""
    merged: dict[str, Metric] = {}
    sources = [(name, text) for name, text in sorted(texts.items())] + [(None, extra)]
    for replica, text in sources:
        text = text.decode() if isinstance(text, bytes) else text
        for family in text_string_to_metric_families(text):
            out = merged.setdefault(family.name, Metric(family.name, family.documentation,
                                                        family.type, family.unit))
            for sample in family.samples:
                labels = dict(sample.labels)
                if replica is not None:
                    labels[REPLICA_LABEL] = replica
                out.add_sample(sample.name, labels, sample.value, sample.timestamp,
                               sample.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(merged.values()))
    return generate_latest(registry)
