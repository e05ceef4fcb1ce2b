from pagedmoe.sampling_params import SamplingParams
from pagedmoe.structured_output.grammar import Grammar


class StructuredOutputManager:
    """The engine's seam to structured outputs: a Grammar for each constrained request. The compiler (and
    xgrammar's tokenizer tables) is built on the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.compiler = None

    def grammar_for(self, params: SamplingParams) -> Grammar | None:
        if params.structured_outputs is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured_outputs need a tokenizer (the engine has skip_tokenizer_init=True)")
        compiler = self.compiler_for_tokenizer()
        return Grammar(compiler.xgr, compiler.compile(params.structured_outputs), self.stop_token_ids)

    def compiler_for_tokenizer(self):
        if self.compiler is None:
            from pagedmoe.structured_output.compiler import GrammarCompiler
            self.compiler = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self.compiler
