"""Which resident expert a layer's cache evicts: the least recently used (LRU, Mixtral-offloading's) or the
least frequently used so far (LFU, MoE-Infinity's option; ties to the least recent)."""


class LRUPolicy:
    def __init__(self, num_experts: int):
        self.last_use = [0] * num_experts
        self.clock = 0

    def touch(self, expert: int):
        self.clock += 1
        self.last_use[expert] = self.clock

    def victim(self, candidates: list[int]) -> int:
        return min(candidates, key=self.key)

    def key(self, expert: int):
        return self.last_use[expert]


class LFUPolicy(LRUPolicy):
    def __init__(self, num_experts: int):
        super().__init__(num_experts)
        self.uses = [0] * num_experts

    def touch(self, expert: int):
        super().touch(expert)
        self.uses[expert] += 1

    def key(self, expert: int):
        return self.uses[expert], self.last_use[expert]


POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy}
