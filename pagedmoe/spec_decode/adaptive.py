"""Speculation only where it pays: per batch-size bucket, the measured seconds per emitted token of decode
steps with drafts against steps without, each a ratio of decayed sums (seconds over tokens, so a step that
emitted one token weighs a quarter of one that emitted four); the faster mode runs (speculation only when
MARGIN cheaper), and the other runs now and then so that its estimate follows the workload: PROBE_EVERY
steps after a change of mode, the gap doubling (up to MAX_PROBE_GAP) while the probes confirm the choice.
A probe of speculation covers SPEC_PROBE_SEQS sequence-steps in at most SPEC_PROBE_STEPS steps (4 steps up to
batch 4, one from batch 16 on), and
its first step is measured with the drafter's catch-up over the positions skipped while plain (a real cost
of switching, which grows with the batch). A probe measures its mode afresh (its stale sums are dropped), and
no step counts for more than OUTLIER times its mode's estimate: a host that paused one plain step for 50 ms had
made speculation look cheaper at batch 64, and plain decoding, no longer measured while speculating, stayed
"slower" for hundreds of steps. A new bucket starts from its nearest neighbour's choice. Outputs do not depend
on the choice (verification is lossless), only speed does."""
from dataclasses import dataclass, field

PROBE_EVERY, MAX_PROBE_GAP = 16, 1024
SPEC_PROBE_SEQS, SPEC_PROBE_STEPS = 16, 4  # a probe of speculation: this many sequence-steps, in at most this
#  many steps. One step of one sequence emits 1 to k + 1 tokens and says little, one of 64 says enough; and
#  its first step pays the drafter's catch-up, which a one-step probe at batch 4 mistook for speculation's cost
MARGIN = 0.9  # speculation is chosen only when it is measured this much cheaper per token: switching to it
#               costs the drafter's catch-up, which the measurement sees once per probe
DECAY = 0.9  # what a mode's sums keep of their past at each step of that mode: about the last ten steps, since at
#             batch 1 a speculating step emits 1 to k + 1 tokens (at 0.7, three unlucky steps in a row switched
#             speculation off, and 22% of the steps ran plain in a simulation where it was 1.6x faster)
OUTLIER = 2.0  # a step counts for at most this many times its mode's estimated seconds for its tokens


def bucket_of(batch_size: int) -> int:
    return max(batch_size, 1).bit_length()  # 1, 2-3, 4-7, 8-15, ...


@dataclass
class Bucket:
    seconds: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})
    tokens: dict[bool, float] = field(default_factory=lambda: {True: 0.0, False: 0.0})
    num_measured: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    num_steps: int = 0
    probe_steps: int = SPEC_PROBE_STEPS  # the steps of a probe of speculation
    faster: bool | None = None  # the mode last found faster
    probe_gap: int = PROBE_EVERY
    next_probe: int = PROBE_EVERY
    probe_left: int = 0  # further steps of the probe under way

    def record(self, speculated: bool, seconds: float, num_emitted: int):
        if (estimate := self.seconds_per_token(speculated)) is not None:
            seconds = min(seconds, OUTLIER * estimate * num_emitted)
        self.seconds[speculated] = DECAY * self.seconds[speculated] + seconds
        self.tokens[speculated] = DECAY * self.tokens[speculated] + num_emitted
        self.num_measured[speculated] += 1

    def seconds_per_token(self, speculated: bool) -> float | None:
        tokens = self.tokens[speculated]
        return self.seconds[speculated] / tokens if tokens else None

    def choice(self) -> bool:
        """Measure both modes first (speculation for a probe's worth of steps), unless the bucket started
        from a neighbour's choice; then the faster, with the slower probed at growing gaps."""
        measured = self.num_measured[True] >= self.probe_steps and self.num_measured[False] > 0
        if not measured and self.faster is None:
            return self.num_measured[True] < self.probe_steps
        faster = self.seconds_per_token(True) < MARGIN * self.seconds_per_token(False) if measured else self.faster
        if faster != self.faster:
            self.faster, self.probe_gap, self.next_probe = faster, PROBE_EVERY, self.num_steps + PROBE_EVERY
        if self.probe_left:
            self.probe_left -= 1
            return not faster
        if self.num_steps < self.next_probe:
            return faster
        self.probe_gap = min(2 * self.probe_gap, MAX_PROBE_GAP)
        self.next_probe, self.probe_left = self.num_steps + self.probe_gap, self.probe_steps - 1 if not faster else 0
        self.forget(not faster)
        return not faster

    def forget(self, speculated: bool):
        """A probe's mode is measured afresh: its sums date from before the gap."""
        self.seconds[speculated] = self.tokens[speculated] = 0.0
        self.num_measured[speculated] = 0

    def start_from(self, neighbour: "Bucket"):
        """A new bucket takes a neighbour's choice and probes the other mode PROBE_EVERY steps on: a draining
        batch crosses buckets quickly, and measuring speculation afresh in each would make the drafter catch
        up over every sequence's whole context each time."""
        self.faster = neighbour.faster


class AdaptiveSwitch:
    def __init__(self):
        self.buckets: dict[int, Bucket] = {}
        self.carried_s = 0.0  # the last step's drafting time, owed by the step that verifies the drafts

    def should_speculate(self, batch_size: int) -> bool:
        return self.bucket(batch_size).choice()

    def bucket(self, batch_size: int) -> Bucket:
        key = bucket_of(batch_size)
        if key not in self.buckets:
            self.buckets[key] = Bucket(probe_steps=min(SPEC_PROBE_STEPS, -(-SPEC_PROBE_SEQS // (1 << (key - 1)))))
            decided = [k for k, b in self.buckets.items() if b.faster is not None]
            if decided:
                self.buckets[key].start_from(self.buckets[min(decided, key=lambda k: abs(k - key))])
        return self.buckets[key]

    def record(self, batch_size: int, speculated: bool, step_s: float, num_emitted: int, proposal_s: float = 0.0):
        """One decode step of batch_size sequences that emitted num_emitted tokens in step_s seconds, of
        which proposal_s went to drafting for the next step: that time is charged to the next step."""
        seconds, self.carried_s = step_s - proposal_s + self.carried_s, proposal_s
        if num_emitted > 0:
            bucket = self.bucket(batch_size)
            bucket.record(speculated, seconds, num_emitted)
            bucket.num_steps += 1


def decode_step_kind(sched) -> bool | None:
    """Read before the step runs: None for a step with prompt (or recomputed) tokens, else whether it
    verifies draft tokens."""
    num_drafts = 0
    for seq, num_new in zip(sched.seqs, sched.num_new_tokens):
        drafts = len(seq.spec_token_ids)
        if num_new != 1 + drafts or seq.num_computed_tokens != len(seq.token_ids) - 1:
            return None
        num_drafts += drafts
    return num_drafts > 0


def make_switch(config) -> AdaptiveSwitch | None:
    return AdaptiveSwitch() if config is not None and config.adaptive else None
