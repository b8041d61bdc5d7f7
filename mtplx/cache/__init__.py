"""Where a forward's keys, values and recurrent state live, below both ``models/`` and
``engine/``: ``attention.py`` (AttentionMetadata, the reference paged attention and the
dispatch to the Triton kernel), ``kv_cache.py`` (the paged KV tensors), ``state_cache.py``
(hybrid models' recurrent state), ``block_manager.py`` (block accounting and the prefix cache)."""
