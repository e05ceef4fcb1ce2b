"""Small-model trainer: byte-level BPE tokenizer, MoE/dense decoders built from HF classes, HF export.

Entry point: `python -m pagedmoe.train {tokenizer,train,export,compare}` (see `pagedmoe.train.cli`).
"""
