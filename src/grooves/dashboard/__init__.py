"""``grooves dashboard``: a local web app over the runs root.

Runs and their status, a run's curves (per reward component with the held-out overlay, KL,
entropy, length, clipfrac) with its alerts on the same step axis, live while the run trains;
review of a step's top, bottom and random samples with labelling (the labels
``grooves review --label`` writes); multi-turn transcripts with the trained tokens marked; and
two checkpoints compared on the run's held-out tasks. It reads the run store and writes only
labels. Every asset ships in ``static/`` (the page's own JS and a vendored copy of uPlot for
the charts): it works offline.

The app is ``grooves.dashboard.app`` (``create_app``, ``serve``). This file imports nothing, so
the package and its modules never import each other in a circle.
"""
