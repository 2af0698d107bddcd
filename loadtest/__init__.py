"""The load tester: seeded workloads, a streaming client, open/closed-loop drivers, reports.

Entry points: ``fleet-loadtest run|compare|make-trace`` (:mod:`loadtest.cli`), ``fleet-router
demo`` (:mod:`loadtest.demo`), ``loadtest/locustfile.py``; in code, :func:`loadtest.runner.execute`
with a :class:`loadtest.runner.RunSettings`.
"""
