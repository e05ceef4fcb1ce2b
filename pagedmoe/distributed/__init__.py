"""Past one process: tensor and expert parallelism over torch.distributed (gloo on CPU), ranks started as
spawned processes the way vLLM's multiprocessing executor starts them."""
