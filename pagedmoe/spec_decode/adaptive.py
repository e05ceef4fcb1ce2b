"""Speculation only where it pays: per batch-size bucket, the measured seconds per emitted token of decode
steps with drafts against steps without, each a moving average; the faster mode runs, and every PROBE_EVERY
decode steps of a bucket the other mode runs once so that its estimate follows the workload. Outputs do not
depend on the choice (verification is lossless), only speed does."""
from dataclasses import dataclass, field

PROBE_EVERY = 16
SMOOTHING = 0.2  # weight of the newest step in the moving averages


def bucket_of(batch_size: int) -> int:
    return max(batch_size, 1).bit_length()  # 1, 2-3, 4-7, 8-15, ...


@dataclass
class Bucket:
    seconds_per_token: dict[bool, float | None] = field(default_factory=lambda: {True: None, False: None})
    num_steps: int = 0

    def record(self, speculated: bool, seconds_per_token: float):
        old = self.seconds_per_token[speculated]
        self.seconds_per_token[speculated] = seconds_per_token if old is None else \
            old + SMOOTHING * (seconds_per_token - old)

    def choice(self) -> bool:
        """Measure both modes first, then the faster, with the slower probed every PROBE_EVERY steps."""
        spec, plain = self.seconds_per_token[True], self.seconds_per_token[False]
        if spec is None or plain is None:
            return spec is None
        faster = spec < plain
        return (not faster) if self.num_steps % PROBE_EVERY == PROBE_EVERY - 1 else faster


class AdaptiveSwitch:
    def __init__(self):
        self.buckets: dict[int, Bucket] = {}

    def should_speculate(self, batch_size: int) -> bool:
        return self.buckets.setdefault(bucket_of(batch_size), Bucket()).choice()

    def record(self, batch_size: int, speculated: bool, step_s: float, num_emitted: int):
        """One decode step of batch_size sequences that emitted num_emitted tokens in step_s seconds."""
        if num_emitted > 0:
            bucket = self.buckets.setdefault(bucket_of(batch_size), Bucket())
            bucket.record(speculated, step_s / num_emitted)
            bucket.num_steps += 1


def decode_step_kind(sched) -> bool | None:
    """Read before the step runs: None for a step with prompt (or recomputed) tokens, else whether it
    verifies draft tokens."""
    for seq, num_new in zip(sched.seqs, sched.num_new_tokens):
        if seq.num_computed_tokens != len(seq) - 1 or num_new != 1 + len(seq.spec_token_ids):
            return None
    return any(seq.spec_token_ids for seq in sched.seqs)


def make_switch(config) -> AdaptiveSwitch | None:
    return AdaptiveSwitch() if config is not None and config.adaptive else None
