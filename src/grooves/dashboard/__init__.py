"""``grooves dashboard``: a local web app over the runs root.

Runs and their status, a run's curves (per reward component with the held-out overlay, KL,
entropy, length, clipfrac) with its alerts on the same step axis, live while the run trains;
review of a step's top, bottom and random samples with labelling (the labels
``grooves review --label`` writes); multi-turn transcripts with the trained tokens marked; and
two checkpoints compared on the run's held-out tasks. It reads the run store and writes only
labels. Every asset ships in ``static/`` (hand-written JS, SVG charts): it works offline.
"""

from grooves.dashboard.app import create_app, serve

__all__ = ["create_app", "serve"]
