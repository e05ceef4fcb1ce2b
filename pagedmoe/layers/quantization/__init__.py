"""Quantized weight formats: MXFP4 (gpt-oss), NVFP4 (NVIDIA ModelOpt) and FP8 with 128x128 block scales
(DeepSeek-V3). Each format file decodes its tensors exactly (a table lookup times power-of-two or float8
scales) and encodes them as its producer does; checkpoint.py reads a checkpoint's quantized tensors as the
dense ones the models load, and config.py reads which format and which modules a checkpoint says it holds."""
