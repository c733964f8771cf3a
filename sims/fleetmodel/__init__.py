"""The job-level model: time to train over weeks on 1,000 to 100,000 GPUs, by recovery method.

``python -m sims jobmodel`` (:mod:`.cli`) and ``python -m sims report jobmodel`` (:mod:`.plots`);
docs/jobmodel.md explains the model, its inputs and its results. Modules, one job each:
:mod:`.sources` (the input files), :mod:`.formulas` (Young, Daly, Meta's ETTR),
:mod:`.failures` (when failures come and what they take down), :mod:`.decided` (the
decided-configuration latency table), :mod:`.calibrate` (writes that table from simulator runs),
:mod:`.costs` (the job and each method's sourced costs), :mod:`.simulate` (the event model),
:mod:`.scenarios` (the named set-ups: the reference fleet, the published cases).

Unlike :mod:`sims.jobmodel` (training steps over seconds on a simulated fleet of real protocol
cores), this model's unit is a failure, not a datagram.
"""
