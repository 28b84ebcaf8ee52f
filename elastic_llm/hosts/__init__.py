"""Several hosts on one machine, for tests, chaos and ``bench partitions``: network namespaces on a
virtual switch and their links' faults (:mod:`.lab`; standard library only, so any layer may use
it). The Ray cluster whose nodes and driver each run on one of its hosts is the runtime's
(:mod:`elastic_llm.runtime.lab_cluster`)."""
