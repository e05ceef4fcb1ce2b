"""Speculation only where it pays: per batch-size bucket, the measured seconds per emitted token of decode
steps with drafts against steps without, each a moving average; the faster mode runs, and the other runs
once now and then so that its estimate follows the workload: PROBE_EVERY steps after a change of mode, the
gap doubling (up to MAX_PROBE_GAP) while the probes confirm the choice. The first step with drafts after
steps without is not measured: its drafting also caught a draft model's KV up over the skipped positions, a
cost of the switch, not of speculating; a probe of speculation therefore runs two steps. Outputs do not
depend on the choice (verification is lossless), only speed does."""
from dataclasses import dataclass, field

PROBE_EVERY, MAX_PROBE_GAP = 16, 256
SMOOTHING = 0.2  # weight of the newest step in the moving averages


def bucket_of(batch_size: int) -> int:
    return max(batch_size, 1).bit_length()  # 1, 2-3, 4-7, 8-15, ...


@dataclass
class Bucket:
    seconds_per_token: dict[bool, float | None] = field(default_factory=lambda: {True: None, False: None})
    num_steps: int = 0
    faster: bool | None = None  # the mode last found faster
    probe_gap: int = PROBE_EVERY
    next_probe: int = PROBE_EVERY
    probe_left: int = 0  # further steps of the probe under way

    def record(self, speculated: bool, seconds_per_token: float):
        old = self.seconds_per_token[speculated]
        self.seconds_per_token[speculated] = seconds_per_token if old is None else \
            old + SMOOTHING * (seconds_per_token - old)

    def choice(self) -> bool:
        """Measure both modes first, then the faster, with the slower probed at growing gaps."""
        spec, plain = self.seconds_per_token[True], self.seconds_per_token[False]
        if spec is None or plain is None:
            return spec is None
        faster = spec < plain
        if faster != self.faster:
            self.faster, self.probe_gap, self.next_probe = faster, PROBE_EVERY, self.num_steps + PROBE_EVERY
        if self.probe_left:
            self.probe_left -= 1
            return not faster
        if self.num_steps < self.next_probe:
            return faster
        self.probe_gap = min(2 * self.probe_gap, MAX_PROBE_GAP)
        self.next_probe, self.probe_left = self.num_steps + self.probe_gap, int(not faster)
        return not faster


class AdaptiveSwitch:
    def __init__(self):
        self.buckets: dict[int, Bucket] = {}
        self.carried_s = 0.0  # the last step's drafting time, owed by the step that verifies the drafts
        self.last_speculated = False

    def should_speculate(self, batch_size: int) -> bool:
        return self.buckets.setdefault(bucket_of(batch_size), Bucket()).choice()

    def record(self, batch_size: int, speculated: bool, step_s: float, num_emitted: int, proposal_s: float = 0.0):
        """One decode step of batch_size sequences that emitted num_emitted tokens in step_s seconds, of
        which proposal_s went to drafting for the next step: that time is charged to the next step."""
        seconds, self.carried_s = step_s - proposal_s + self.carried_s, proposal_s
        warm_up, self.last_speculated = speculated and not self.last_speculated, speculated
        if num_emitted > 0:
            bucket = self.buckets.setdefault(bucket_of(batch_size), Bucket())
            if not warm_up:
                bucket.record(speculated, seconds / num_emitted)
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
