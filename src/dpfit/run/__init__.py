"""The stages of a training run, in order; :func:`dpfit.train.train` conducts them.

- :mod:`~dpfit.run.resolve`: options, paths and the recipe's numbers, before any data is read
- :mod:`~dpfit.run.prepare`: data and model through the task plug-in, trainables, the recipe
- :mod:`~dpfit.run.head_first`, :mod:`~dpfit.run.main_phase`, :mod:`~dpfit.run.loop`: the
  private phases (head-first, then full and/or bias), one ledger
- :mod:`~dpfit.run.release`: outputs, the partial record of a stopped run, checkpoints claimed

:mod:`~dpfit.run.config` (TrainConfig) is what plug-ins (tasks, windows, recipes) may import;
they never import a stage.
"""
