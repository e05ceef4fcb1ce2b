"""A gpt-oss checkpoint (MXFP4 experts) to GGUF with llama.cpp's own converter, for the llama.cpp baseline of
`pagedmoe bench throughput --baseline llama.cpp --gguf OUT` (docs/BENCHMARKS.md, issue 15).

    python scripts/convert_gpt_oss_gguf.py LLAMA_CPP_DIR MODEL_DIR OUT.gguf

LLAMA_CPP_DIR: a llama.cpp source tree with convert_hf_to_gguf.py (e.g. vendor/llama.cpp of the
llama-cpp-python sdist: `pip download --no-binary :all: --no-deps llama-cpp-python`). The bench models carry
a test tokenizer the converter cannot read, so the vocab section is written as 'none', as pagedmoe's own
GGUF writer does for dense models (the bench feeds token ids); everything else, the MXFP4 repacking of the
experts included, is the converter's. The rest of the model is written in bf16, as pagedmoe runs it."""
import runpy
import sys
from pathlib import Path


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    llama_cpp, model, out = sys.argv[1:]
    sys.path[:0] = [llama_cpp, str(Path(llama_cpp) / "gguf-py")]
    from conversion.gpt_oss import GptOssModel

    def no_vocab(self):
        self.gguf_writer.add_tokenizer_model("none")
        self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])
    GptOssModel.set_vocab = no_vocab
    converter = str(Path(llama_cpp) / "convert_hf_to_gguf.py")
    sys.argv = [converter, model, "--outfile", out, "--outtype", "bf16"]
    runpy.run_path(converter, run_name="__main__")


if __name__ == "__main__":
    main()
