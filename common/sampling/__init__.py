"""Sampling: the sampler, penalties and logit adjustments, grammar masks, top logprobs, stop checks."""
