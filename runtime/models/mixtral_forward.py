"""Mixtral's forward pass: the decoder's, with the top-k weights kept in float32."""

from __future__ import annotations

from .decoder import MoEDecoder


class MixtralDecoder(MoEDecoder):
    cast_router_weights = False
