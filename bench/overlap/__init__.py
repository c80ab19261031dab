"""The overlap benchmark: how much all-to-all time each pipeline schedule hides under compute, on pp x ep
CPU or GPU ranks, on loopback or the emulated cluster (:mod:`bench.cluster`), with the step time, the bubble
and where each rank's step went. ``python -m bench.overlap --help``.

- :mod:`bench.overlap.cli`: the command; launches the ranks, merges their files, writes the JSON, trace, PNG.
- :mod:`bench.overlap.run`: one rank; builds every mode on the same weights and data, records its events.
- :mod:`bench.overlap.torch_peer`: the peer, torch's ``ScheduleDualPipeV`` on our model, with and without the bridge.
- :mod:`bench.overlap.stats`: pure functions of the events (spans, hidden all-to-all, bubble, trace).
- :mod:`bench.overlap.report`: per-mode rows, targets and tables; ``python -m bench.overlap.report`` on saved
  rank files.
- :mod:`bench.overlap.traffic`: bytes per all-to-all, FP8 dispatch beside the model dtype.
- :mod:`bench.overlap.plot`: the timeline picture.
- :mod:`bench.overlap.costs`: one MoE layer's sub-stage seconds in the planner's costs format.
- :mod:`bench.overlap.calibrate`: the planner's prediction from those costs beside the measured overlapped step
  (``python -m bench.overlap.calibrate``).
"""
