"""``elastic-llm chaos``: a seeded fault soak of real runs on a loopback Ray cluster, checked
against an undisturbed reference run (plan: the schedule; runner: the cluster, the runs and the
injections; report: the verdict)."""
