"""Benchmarks of elastic-llm against real peers, each peer measured side by side in one run.

They ship with the source checkout, not with the installed package: run them from the checkout's
root as ``elastic-llm bench pipeline|erasure|snapshot`` or ``python -m benchmarks.<name>`` (the
same options). Results and the machines they ran on are in ``BENCHMARKS.md``.

Must never: copy product code (they import and call ``elastic_llm``), or judge their results in
code: what a figure means, and the targets it is held to, are written in ``BENCHMARKS.md``.
"""
