"""Experiments that drive the product's own training runs and compare how they converge.

Owns: the ``elastic-llm experiment`` building blocks — :mod:`.convergence` (strategies as config
overrides, the failure-rate mapping, the grid, the target loss, rows and the Markdown report;
pure), :mod:`.runner` (runs each cell through :class:`~elastic_llm.controller.Trainer`, resumes
finished cells, writes the files) and :mod:`.plot` (the loss-against-time figure). Importing this
package must never import Ray or matplotlib: import the submodule you need.
"""
