"""What the benchmark scripts share, one copy each: a script imports ``harness.<module>``
(benchmarks/ is on sys.path when a script runs or a test loads it).

- ``timing``: best and median of repeated calls.
- ``stats``: the paired t interval.
- ``records``: JSONL result logs, read and appended.
- ``render``: generated blocks written into docs pages between markers.
- ``memory``: resident-set probes of a worker process (now, peak, peak reset).
- ``workers``: one measurement in a fresh process that prints its result as JSON.
"""
