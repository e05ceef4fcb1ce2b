"""Speculative decoding: a proposer guesses up to k tokens per sequence, the target model scores them in the
next step's forward, and the tokens the target's own sampler agrees with are kept (see acceptance.py)."""
