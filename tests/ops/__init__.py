"""Tests of mla_compile.ops (a package so that this folder is never put on sys.path, where its
``triton/`` test folder would shadow the real Triton)."""
