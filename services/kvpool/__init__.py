"""kvpool: a model replica with a paged, ref-counted KV block pool (see engine.py)."""
