from tokenizers.decoders import DecodeStream

from pagedmoe.engine.sequence import Sequence

NUM_CONTEXT_TOKENS = 5


class Detokenizer:
    """Incremental detokenization with tokenizers' DecodeStream, primed with the last prompt tokens so
    the first output token decodes with its leading space."""

    def __init__(self, tokenizer):
        self.backend = tokenizer.backend_tokenizer if tokenizer is not None else None

    def append(self, seq: Sequence, token_id: int) -> str:
        if self.backend is None or not seq.params.detokenize:
            return ""
        if seq.decode_stream is None:
            context = seq.token_ids[max(seq.num_prompt_tokens - NUM_CONTEXT_TOKENS, 0):seq.num_prompt_tokens]
            seq.decode_stream = DecodeStream(ids=context, skip_special_tokens=seq.params.skip_special_tokens)
        text = seq.decode_stream.step(self.backend, token_id) or ""
        seq.output_text += text
        return text
