"""Models that know nothing of pipelining: the GPT and its tensor-parallel layers."""
