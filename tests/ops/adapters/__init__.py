"""Contract tests of the peer-library adapters (fake libraries on CPU) and their CUDA tests."""
