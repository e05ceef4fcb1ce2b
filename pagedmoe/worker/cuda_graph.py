"""CUDA graphs for decode steps, as vLLM captures them: one graph per batch size in a list (1, 2, 4, then
multiples of 8), each replaying the model's forward on static buffers; a step of n decodes copies its input
ids, positions, slots, block tables and lengths into the first n rows and pads up to the next captured size.
A padding row writes its KV nowhere (slot -1, which the Triton KV write skips) and attends no position
(seq_len 0), so real KV is never touched. Prefills, steps above the largest size and every step on CPU run
eagerly. A replayed step counts no expert load (its bincount would sync the host inside the graph)."""
import logging

import torch

from pagedmoe.config import EngineConfig
from pagedmoe.layers.attention.metadata import AttentionMetadata, Workspace

MAX_CAPTURE_SIZE = 512
logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to max_num_seqs (and MAX_CAPTURE_SIZE), max_num_seqs included."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in [1, 2, 4, *range(8, top + 1, 8)] if s <= top]
    return sizes if sizes[-1] == top else sizes + [top]


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding num_seqs decodes; None above the largest (the step runs eagerly)."""
    return next((size for size in sizes if size >= num_seqs), None)


class DecodeBuffers:
    """The static tensors a captured decode step reads (a graph replays on their addresses)."""

    def __init__(self, max_seqs: int, max_blocks_per_seq: int, device: torch.device):
        int32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_seqs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_seqs, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_seqs,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, **int32)
        self.seq_lens = torch.zeros(max_seqs, **int32)
        self.query_starts = torch.arange(max_seqs, **int32)  # one query token per sequence
        self.query_lens = torch.ones(max_seqs, **int32)

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int):
        """The step's n decodes into rows [0, n); rows [n, size) reset to padding."""
        n, step = len(input_ids), meta.triton
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n].zero_()
        self.block_tables[:n, :step.block_tables.shape[1]].copy_(step.block_tables)
        self.seq_lens[:n].copy_(step.seq_lens)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].zero_()

    def metadata(self, size: int, kv_caches: torch.Tensor, block_size: int, workspace: Workspace,
                 num_splits: int) -> AttentionMetadata:
        """Metadata over the first `size` rows, for the Triton kernels (a graph captures these views)."""
        from pagedmoe.layers.attention.triton_backend import TritonAttention
        meta = AttentionMetadata(self.slot_mapping[:size], kv_caches, [], block_size, workspace)
        meta.triton = TritonAttention(self.block_tables[:size], self.seq_lens[:size], self.query_starts[:size],
                                      self.query_lens[:size], 1, num_splits, self.slot_mapping[:size])
        return meta


class DecodeGraphs:
    """The captured graphs of a model's decode forward, one per size, sharing one memory pool."""

    def __init__(self, model, sizes: list[int], max_blocks_per_seq: int, kv_caches: torch.Tensor,
                 block_size: int, workspace: Workspace, num_splits: int):
        self.model, self.sizes = model, sizes
        self.buffers = DecodeBuffers(sizes[-1], max_blocks_per_seq, kv_caches.device)
        self.metas = {size: self.buffers.metadata(size, kv_caches, block_size, workspace, num_splits)
                      for size in sizes}
        self.graphs, self.outputs = {}, {}

    def capture(self):
        pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool
            self._forward(size)  # warm-up: Triton compiles, allocator settles
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size], pool = graph, graph.pool()

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.buffers.input_ids[:size], self.buffers.positions[:size], self.metas[size])

    def size_for(self, meta: AttentionMetadata, num_tokens: int) -> int | None:
        """The captured size a step replays at, or None: it runs eagerly."""
        if meta.triton is None or meta.triton.max_query_len != 1 or meta.window is not None:
            return None
        return padded_size(num_tokens, self.sizes)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               size: int) -> torch.Tensor:
        self.buffers.fill(input_ids, positions, meta, size)
        self.graphs[size].replay()
        return self.outputs[size][:len(input_ids)]


def make_decode_graphs(config: EngineConfig, model, kv_caches: torch.Tensor, workspace: Workspace,
                       triton_attention: bool, has_drafter: bool) -> DecodeGraphs | None:
    """Captured decode graphs, or None where they do not apply: CPU, enforce_eager, the PyTorch attention path
    (its metadata is built on the host), several ranks, or a draft model (its hidden-state inputs)."""
    if torch.device(config.device).type != "cuda" or config.enforce_eager or not triton_attention:
        return None
    if config.world_size > 1 or has_drafter:
        return None
    from pagedmoe.layers.attention.triton_backend import decode_splits
    max_blocks_per_seq = -(-config.max_model_len // config.block_size)
    graphs = DecodeGraphs(model, capture_sizes(config.max_num_seqs), max_blocks_per_seq, kv_caches,
                          config.block_size, workspace, decode_splits(config.max_model_len))
    try:
        graphs.capture()
    except RuntimeError as error:  # an op that syncs the host cannot be captured: eager is still correct
        logger.warning("decode steps run eagerly, CUDA graph capture failed: %s", error)
        return None
    return graphs
