"""Generators of the docs pages that come from the code and the results (run by scripts/gen_docs.py)."""
