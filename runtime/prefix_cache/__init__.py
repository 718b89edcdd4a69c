"""Prefix reuse across requests: the canonical prefill grid (`boundaries`), segmented prefill
(`prefill`), a radix tree of K/V rows (`radix`), a bounded pool of recurrent-state anchors
(`anchors`) and the facade the generation loop calls (`cache`). See docs/prefix-cache.md."""
