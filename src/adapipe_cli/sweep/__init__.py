"""Sweeps: a grid of runs (depth x batch size x method x seed), each a Hydra multirun job, and its report.

- :mod:`.grid`: the grid config and its cells; :mod:`.state`: ``sweep.json`` and cell status;
- :mod:`.profile`: one cost profile per depth; :mod:`.target`: the targets and time-to-target;
- :mod:`.run`: running the cells, ``sweep.jobs`` at a time; :mod:`.progress`: one line per cell;
- :mod:`.results`, :mod:`.bootstrap`, :mod:`.markdown`, :mod:`.plots`, :mod:`.report`: ``adapipe report``.
"""
