"""Reads a metrics exposition on stdin with Prometheus' own Python client.

Usage: python3 exposition.py text|openmetrics < exposition

`text` uses the Prometheus text format (0.0.4) parser, `openmetrics` the
OpenMetrics 1.0 parser, which is strict: it rejects a missing `# EOF`, a
counter sample without `_total`, a family split in two, buckets out of order
and more. Prints one JSON object per family: name, type and its samples
(name, labels); exits non-zero with the parser's reason when the exposition
is invalid.
"""

import json
import sys

from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families as text_families

PARSERS = {"text": text_families, "openmetrics": openmetrics_families}


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in PARSERS:
        print(__doc__, file=sys.stderr)
        return 2
    exposition = sys.stdin.read()
    try:
        families = list(PARSERS[sys.argv[1]](exposition))
    except ValueError as e:
        print(f"invalid {sys.argv[1]} exposition: {e}", file=sys.stderr)
        return 1
    for family in families:
        samples = [{"name": s.name, "labels": s.labels} for s in family.samples]
        print(json.dumps({"name": family.name, "type": family.type, "samples": samples}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
