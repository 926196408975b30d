"""The model floor: what a DeepSeek model is and how its weights get in.

Configuration and presets (``config``), rotary embedding (``rope``), the per-step metadata the model reads
(``metadata``: dataclasses of tensors, the model's input contract; the serving floor builds them), the latent
cache (``cache``), attention, the V3.2 indexer, MoE, the patched model (``model``: :func:`patch`), fp8 / fp4
linears and experts, checkpoint reading (``checkpoint``, ``fp4_checkpoint``, ``loader``: :func:`from_pretrained`)
and DeepSeek-V4 (``v4_model``, ``v4_cache``, ``v4_loader``). Imports ``mla_compile.ops`` and
``mla_compile.parallel``, never the serving or application floors.
"""
