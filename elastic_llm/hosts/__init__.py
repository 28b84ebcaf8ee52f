"""Several hosts on one machine, for tests, ``elastic-llm chaos`` and ``bench partitions``:
network namespaces on a virtual switch (:mod:`.lab`) and a Ray cluster whose nodes and driver
each run in one (:mod:`.raynodes`)."""
