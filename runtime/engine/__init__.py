"""Requests in, token streams out: loading, sampling, the generation loop."""
