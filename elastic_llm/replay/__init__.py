"""Replay of a spot-instance availability trace on a loopback Ray cluster.

Owns: the ``elastic-llm replay`` building blocks — :mod:`.trace` (parse a trace and plan the
replay, pure), :mod:`.report` (room/useful-time arithmetic and the JSON + PNG report) and
:mod:`.runner` (the part that drives Ray). Importing this package must never import Ray or
matplotlib: import the submodule you need.
"""
