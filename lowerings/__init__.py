"""Inductor lowerings and graph passes for the MLA ops (see issue: Inductor lowerings)."""
