"""The serving floor: planning and driving steps of a model.

Blocks (``block_manager``), admission checks, sampling, the metadata builders (``builder``, ``v4_builder``:
host planning into persistent buffers before each step), the engine (``engine``: continuous batching, aborts,
failed steps), greedy generation (``generate``) and the memory plan behind ``mla-compile plan``. Imports the
model floor and ``mla_compile.ops``, never the application floor.
"""
