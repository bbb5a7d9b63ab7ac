"""Sweeps: a grid of runs (depth x batch size x method x seed) on Hydra's multirun, and its report.

- :mod:`.grid`: the grid config and its cells; :mod:`.state`: ``sweep.json`` and cell status;
- :mod:`.profile`: one cost profile per depth; :mod:`.target`: the target and time-to-target;
- :mod:`.run`: running the cells; :mod:`.progress`: one line per cell;
- :mod:`.results`, :mod:`.markdown`, :mod:`.plots`, :mod:`.report`: ``adapipe report``.
"""
