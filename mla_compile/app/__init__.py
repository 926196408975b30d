"""The application floor: what a person runs.

The ``mla-compile`` command (``cli``), the demo, ``doctor``, text generation from a checkpoint (``textgen``) and
the toy models tests and demos build (``toy``, ``v4_toy``). Imports every floor below it; nothing imports it
except tests and benchmarks.
"""
